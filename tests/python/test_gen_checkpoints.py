"""scripts/gen_checkpoints.py writes checkpoints that diffusers and transformers load from their own
config.json with no missing, unexpected or mismatched key, and pipeline folders that
DiffusionPipeline.from_pretrained loads whole (scheduler and tokenizers included), through pinload's
hooks and without them, to the same tensors.

Every component of every --only choice is checked at both scales against the class built from the
config the script writes (on the meta device: the full scale is never written here); the small
scale is written and loaded, and holds weight-like values (finite, each tensor kind's scale), seeded
and independent of which other files were written; random bytes stay an option (--fill random)."""

import importlib.util
import json
import os
import re
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


# ---------------------------------------------------------------- values (Note [Weight-like values])

def _kind(name, shape):
    """The test's own reading of a tensor's kind, from its name (not the script's tensor_kind)."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    if leaf == "bias":
        return "bias"
    if leaf == "weight" and len(shape) == 1 and re.search(r"norm|^ln(_|$)", last):
        return "norm"
    return "weight"


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_small_models_hold_weight_like_values(small, pipeline):
    """Every floating tensor finite, at its kind's scale: weights and embeddings N(0, 0.02), norms'
    weights near 1, biases near 0. Read with safetensors (the independent reader)."""
    from safetensors.torch import load_file

    seen = {"weight": 0, "norm": 0, "bias": 0}
    files = sorted((small / pipeline).rglob("*.safetensors"))
    assert files
    for f in files:
        for name, t in load_file(str(f)).items():
            assert t.is_floating_point(), f"{f}: {name} is {t.dtype}"
            x = t.float()
            assert torch.isfinite(x).all(), f"{f}: {name} holds NaN or inf"
            kind = _kind(name, t.shape)
            seen[kind] += 1
            if x.numel() < 256:
                continue
            mean, std = x.mean().item(), x.std().item()
            want_mean, want_std = {"weight": (0.0, 0.02), "norm": (1.0, 0.02), "bias": (0.0, 0.01)}[kind]
            assert abs(mean - want_mean) < 0.2 * want_std + 0.005, f"{f}: {name} ({kind}): mean {mean}"
            assert 0.7 * want_std < std < 1.3 * want_std, f"{f}: {name} ({kind}): std {std}"
    assert all(seen.values()), seen


def _write(out, *args):
    assert gen.main(["--scale", "small", "--out", str(out), *args]) == 0


def _shm_dir(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (2 << 30) else None
    return Path(tempfile.mkdtemp(prefix="pinload-gen-", dir=base or str(tmp_path)))


def test_values_are_seeded_and_independent_of_the_other_files(tmp_path):
    root = _shm_dir(tmp_path)
    try:
        vae = Path("flux-dev-small/vae/diffusion_pytorch_model.safetensors")
        _write(root / "all", "--only", "clip-l,vae")
        _write(root / "alone", "--only", "vae")
        _write(root / "seed1", "--only", "vae", "--seed", "1")
        one = (root / "all" / vae).read_bytes()
        assert one == (root / "alone" / vae).read_bytes(), "the VAE's bytes depend on the files written before it"
        other = (root / "seed1" / vae).read_bytes()
        assert len(other) == len(one) and other != one, "--seed changes nothing"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_files_of_another_fill_are_rewritten_and_random_bytes_stay_an_option(tmp_path, capsys):
    """--fill random writes random bytes (NaN and inf in bf16); the default run then rewrites those
    files (the fill's version is in the header) and a second run keeps them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = _shm_dir(tmp_path)
    try:
        path = root / "flux-dev-small" / "vae" / "diffusion_pytorch_model.safetensors"
        _write(root, "--only", "vae", "--fill", "random")
        with safe_open(str(path), framework="pt") as f:
            assert "pinload_fill" not in f.metadata()
        assert not all(torch.isfinite(t.float()).all() for t in load_file(str(path)).values())
        capsys.readouterr()
        _write(root, "--only", "vae")
        assert f"{path}: " in (out := capsys.readouterr().out) and "wrote in" in out, out
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata()["pinload_fill"] == gen.FILL_VERSION
        assert all(torch.isfinite(t.float()).all() for t in load_file(str(path)).values())
        _write(root, "--only", "vae")
        assert "exists, kept" in capsys.readouterr().out
    finally:
        shutil.rmtree(root, ignore_errors=True)
