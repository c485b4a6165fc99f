"""scripts/gen_checkpoints.py writes checkpoints that diffusers and transformers load from their own
config.json with no missing, unexpected or mismatched key, and pipeline folders that
DiffusionPipeline.from_pretrained loads whole (scheduler and tokenizers included), through pinload's
hooks and without them, to the same tensors.

Every component of every --only choice is checked at both scales against the class built from the
config the script writes (on the meta device: the full scale is never written here); the small
scale is written and loaded."""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import pinload
from pl_helpers import assert_same

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tokenizers")

transformers.logging.set_verbosity_error()
diffusers.utils.logging.set_verbosity_error()
try:
    diffusers.utils.logging.disable_progress_bar()
except AttributeError:
    pass

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_checkpoints.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gen_checkpoints", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_checkpoints"] = module
    spec.loader.exec_module(module)
    return module


gen = load_script()


def every_component(scale):
    return [c for make in (gen.components, gen.sdxl_components) for c in make(scale)]


def test_every_only_choice_is_a_component():
    keys = {c.key for c in every_component("small")}
    for alias, members in gen.ALIASES.items():
        assert set(members) <= keys, alias
    assert keys == {k for members in gen.ALIASES.values() for k in members}


@pytest.mark.parametrize("scale", ["small", "full"])
def test_configs_build_exactly_the_written_tensors(scale):
    for c in every_component(scale):
        missing, unexpected, mismatched = gen.compare_with_real_class(c)
        assert not (missing or unexpected or mismatched), (
            f"{scale} {c.key} ({c.cls}): missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"mismatched {mismatched[:4]}")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small scale, written (to /dev/shm where it has room: 0.5 GB)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (4 << 30) else None
    out = Path(tempfile.mkdtemp(prefix="pinload-gen-", dir=base or str(tmp_path_factory.getbasetemp())))
    try:
        assert gen.main(["--scale", "small", "--out", str(out)]) == 0
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


PIPELINES = {"flux-dev-small": None, "sdxl-base-small": "fp16"}  # folder: variant


def load_info(cls, folder, variant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = cls.from_pretrained(folder, variant=variant, output_loading_info=True)
    return {k: sorted(v) if not isinstance(v, (str, bool)) else v for k, v in info.items()}


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_small_components_load_clean(small, pipeline):
    root = small / pipeline
    index = json.loads((root / "model_index.json").read_text())
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or name.startswith(("tokenizer", "scheduler")):
            continue
        library, cls_name = entry
        cls = getattr(diffusers if library == "diffusers" else transformers, cls_name)
        info = load_info(cls, root / name, PIPELINES[pipeline])
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            assert not info.get(kind), f"{pipeline}/{name}: {kind} {info[kind][:4]}"


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_small_pipelines_load_whole_patched_and_unpatched(small, pipeline):
    from diffusers import DiffusionPipeline

    variant = PIPELINES[pipeline]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normal = DiffusionPipeline.from_pretrained(small / pipeline, variant=variant)
        with pinload.patch_diffusers() as patch:
            patched = DiffusionPipeline.from_pretrained(small / pipeline, variant=variant)
    assert patch.counts().get("files", 0) >= 4, patch.counts()
    for name, component in normal.components.items():
        assert (component is None) == (patched.components[name] is None), name
        if isinstance(component, torch.nn.Module):
            want, got = component.state_dict(), patched.components[name].state_dict()
            assert sorted(got) == sorted(want), name
            for k in want:
                assert_same(got[k], want[k], f"{name}.{k}")
    # The tokenizers and the scheduler are there and work.
    ids = normal.tokenizer("a photo of a cat").input_ids
    assert ids[0] == normal.tokenizer.bos_token_id and ids[-1] == normal.tokenizer.eos_token_id
    assert normal.tokenizer_2("a photo of a cat").input_ids[-1] == normal.tokenizer_2.eos_token_id
    dynamic = normal.scheduler.config.get("use_dynamic_shifting", False)  # FLUX's: shifted by image size
    normal.scheduler.set_timesteps(4, **({"mu": 1.0} if dynamic else {}))
    assert len(normal.scheduler.timesteps) == 4
