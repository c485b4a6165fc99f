"""``pinload.patch_safetensors()``: safetensors' own ``safe_open``, ``torch.load_file`` and
``torch.load`` through pinload for the whole process, compared with the reference functions
(captured before the patch): same tensors (bytes, dtypes, shapes, order), keys, metadata, slices;
``counts()`` shows the calls pinload served and ``fallbacks`` those it handed back. Then the
callers: ComfyUI's ``load_torch_file`` (a copy pinned to a ComfyUI commit: comfy_utils_copy.py) on
an SDXL-like single file, the ComfyUI custom-node package and the webui extension and
sitecustomize of examples/."""

import hashlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import pinload
from pl_helpers import assert_same

sys.path.insert(0, str(Path(__file__).parent))
import comfy_utils_copy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REFERENCE = {"safe_open": safetensors.safe_open, "load_file": safetensors.torch.load_file,
             "load": safetensors.torch.load}


def realistic(shape, dtype, gen, kind="weight"):
    x = torch.randn(shape, generator=gen)
    x = 1 + 0.02 * x if kind == "norm" else (0.002 * x if kind == "bias" else 0.02 * x)
    return x.to(dtype)


def sdxl_like(path: Path) -> Path:
    """A single-file SDXL-like checkpoint (the original "ldm" names of Civitai files and
    sd_xl_base_1.0.safetensors: UNet, VAE, CLIP-L, OpenCLIP-G), small, with realistic values in
    the dtypes such files hold (fp16, an fp32 tensor, int64 position ids) and modelspec metadata."""
    gen = torch.Generator().manual_seed(0)
    sd = {}
    u = "model.diffusion_model."
    for i, (cin, cout) in enumerate([(4, 32), (32, 32), (32, 64)]):
        b = f"{u}input_blocks.{i}.0."
        sd[b + "in_layers.0.weight"] = realistic((cin,), torch.float16, gen, "norm")
        sd[b + "in_layers.0.bias"] = realistic((cin,), torch.float16, gen, "bias")
        sd[b + "in_layers.2.weight"] = realistic((cout, cin, 3, 3), torch.float16, gen)
        sd[b + "in_layers.2.bias"] = realistic((cout,), torch.float16, gen, "bias")
        sd[b + "emb_layers.1.weight"] = realistic((cout, 128), torch.float16, gen)
    t = f"{u}input_blocks.2.1.transformer_blocks.0."
    for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q"):
        sd[f"{t}{name}.weight"] = realistic((64, 64), torch.float16, gen)
    sd[f"{t}attn2.to_k.weight"] = realistic((64, 160), torch.float16, gen)
    sd[f"{u}out.2.weight"] = realistic((4, 32, 3, 3), torch.float16, gen)
    sd["first_stage_model.encoder.conv_in.weight"] = realistic((32, 3, 3, 3), torch.float16, gen)
    sd["first_stage_model.decoder.norm_out.weight"] = realistic((32,), torch.float16, gen, "norm")
    c = "conditioner.embedders.0.transformer.text_model."
    sd[c + "embeddings.position_ids"] = torch.arange(77, dtype=torch.int64).reshape(1, 77)
    sd[c + "embeddings.token_embedding.weight"] = realistic((400, 32), torch.float16, gen)
    sd[c + "final_layer_norm.weight"] = realistic((32,), torch.float16, gen, "norm")
    g = "conditioner.embedders.1.model."
    sd[g + "text_projection"] = realistic((32, 32), torch.float16, gen)
    sd[g + "transformer.resblocks.0.attn.in_proj_weight"] = realistic((96, 32), torch.float16, gen)
    sd[g + "logit_scale"] = torch.tensor(4.6052, dtype=torch.float32)
    sd["denoiser.sigmas"] = torch.linspace(0.03, 14.6, 1000, dtype=torch.float32)
    metadata = {"modelspec.architecture": "stable-diffusion-xl-v1-base", "modelspec.title": "sdxl-like test",
                "modelspec.sai_model_spec": "1.0.0", "format": "pt"}
    safetensors.torch.save_file(sd, str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sdxl_like(tmp_path_factory.mktemp("sdxl") / "sdxl_like.safetensors")


@pytest.fixture
def patch():
    p = pinload.patch_safetensors()
    try:
        yield p
    finally:
        p.undo()
    assert safetensors.safe_open is REFERENCE["safe_open"] and safetensors.torch.load is REFERENCE["load"]
    assert safetensors.torch.load_file is REFERENCE["load_file"]
    assert safetensors.torch.safe_open is REFERENCE["safe_open"]


def test_safe_open_is_the_reference(ckpt, patch):
    with REFERENCE["safe_open"](str(ckpt), framework="pt") as ref:
        want = {k: ref.get_tensor(k) for k in ref.offset_keys()}
        ref_keys, ref_offset_keys, ref_meta = ref.keys(), ref.offset_keys(), ref.metadata()
        ref_slice = ref.get_slice("denoiser.sigmas")[10:20]
    with safetensors.safe_open(ckpt, framework="pt", device="cpu") as f:  # a Path, as callers pass
        assert isinstance(f, safetensors.safe_open) and isinstance(f, pinload.torch.safe_open)
        assert f.keys() == ref_keys and f.offset_keys() == ref_offset_keys and f.metadata() == ref_meta
        for k in f.keys():
            assert_same(f.get_tensor(k), want[k], k)
        assert_same(f.get_slice("denoiser.sigmas")[10:20], ref_slice)
        got = f.get_tensors()
        assert list(got) == list(want)
    with safetensors.safe_open(str(ckpt), "np") as f:  # framework positionally, numpy arrays
        with REFERENCE["safe_open"](str(ckpt), "np") as ref:
            for k in ref.keys():
                a, b = f.get_tensor(k), ref.get_tensor(k)
                assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), k
    assert patch.counts() == {"safetensors.safe_open": 2, "files": 2} and patch.fallbacks == {}


def test_load_file_and_load_are_the_reference(ckpt, patch):
    with REFERENCE["safe_open"](str(ckpt), framework="pt") as ref:  # what the reference load_file returns
        want = ref.get_tensors()  # (that calls safetensors.torch.safe_open, which the patch routes)
    for got in (safetensors.torch.load_file(str(ckpt)), safetensors.torch.load_file(ckpt, device="cpu", backend="pread"),
                safetensors.torch.load_file(str(ckpt), torch.device("cpu"))):
        assert list(got) == list(want)  # file order
        for k in want:
            assert_same(got[k], want[k], k)
    got, want = safetensors.torch.load(ckpt.read_bytes()), REFERENCE["load"](ckpt.read_bytes())
    assert sorted(got) == sorted(want)  # the reference's order here is its hash map's, a new one per process
    for k in want:
        assert_same(got[k], want[k], k)
    assert patch.counts() == {"safetensors.torch.load_file": 3, "safetensors.torch.load": 1, "files": 4}


def test_what_pinload_does_not_serve_goes_to_the_reference(ckpt, tmp_path):
    """A file pinload refuses gets the reference's own error, worded as the reference words it
    (ComfyUI matches that wording); a call pinload cannot take, the reference's handling. None of
    these counts as pinload's. The reference's errors are taken before the patch: the reference
    load_file opens its file through safetensors.torch.safe_open, which the patch routes."""
    bad = tmp_path / "not_safetensors.safetensors"
    bad.write_bytes(b"\xff" * 64)
    missing = tmp_path / "missing.safetensors"
    empty_header = b"\x08\x00\x00\x00\x00\x00\x00\x00{}"
    want = {}
    for what, call in (("bad", lambda: REFERENCE["safe_open"](str(bad), framework="pt")),
                       ("missing", lambda: REFERENCE["load_file"](str(missing))),
                       ("empty", lambda: REFERENCE["load"](empty_header))):
        with pytest.raises(Exception) as e:
            call()
        want[what] = e.value
    with pinload.patch_safetensors() as patch:
        with pytest.raises(type(want["bad"])) as got:
            safetensors.safe_open(str(bad), framework="pt")
        assert str(got.value) == str(want["bad"])
        with pytest.raises(type(want["bad"])) as got:
            comfy_utils_copy.load_torch_file(str(bad))
        assert str(got.value) == str(want["bad"])
        with pytest.raises(type(want["missing"])) as got:
            safetensors.torch.load_file(str(missing))
        assert str(got.value) == str(want["missing"])
        with pytest.raises(type(want["empty"])):
            safetensors.torch.load(empty_header)
        with pytest.raises(TypeError):
            safetensors.safe_open(str(ckpt))  # no framework: the reference's own TypeError
    assert patch.counts() == {}
    # 4 safe_open fallbacks: 3 calls above, and the reference load_file's own after load_file fell
    # back (it opens through safetensors.torch.safe_open, routed, which hands the file on again)
    assert patch.fallbacks == {"safetensors.safe_open": 4, "safetensors.torch.load_file": 1,
                               "safetensors.torch.load": 1}
    assert safetensors.torch.safe_open is REFERENCE["safe_open"] and safetensors.safe_open is REFERENCE["safe_open"]


def test_the_torch_modules_safe_open_is_routed(ckpt, patch):
    """safetensors.torch re-exports safe_open (``from safetensors import safe_open``): a call through
    that name, or a name imported from it after the patch, is pinload's too, with the reference's
    tensors; undo (the fixture) restores it."""
    assert safetensors.torch.safe_open is safetensors.safe_open
    from safetensors.torch import safe_open as by_name

    with REFERENCE["safe_open"](str(ckpt), framework="pt") as ref:
        want = {k: ref.get_tensor(k) for k in ref.offset_keys()}
    for opener in (safetensors.torch.safe_open, by_name):
        with opener(str(ckpt), framework="pt", device="cpu") as f:
            assert isinstance(f, pinload.torch.safe_open)
            assert f.offset_keys() == list(want)
            for k in want:
                assert_same(f.get_tensor(k), want[k], k)
    assert patch.counts() == {"safetensors.safe_open": 2, "files": 2} and patch.fallbacks == {}


def test_undo_and_nesting(ckpt):
    with pinload.patch_safetensors(threads=2) as outer:
        with pinload.patch_safetensors() as inner:
            safetensors.torch.load_file(str(ckpt))
        assert safetensors.torch.load_file is not REFERENCE["load_file"]
        safetensors.torch.load_file(str(ckpt))
    assert safetensors.torch.load_file is REFERENCE["load_file"] and safetensors.safe_open is REFERENCE["safe_open"]
    assert safetensors.torch.safe_open is REFERENCE["safe_open"]
    assert inner.counts()["safetensors.torch.load_file"] == 1 and outer.counts()["safetensors.torch.load_file"] == 1
    with pytest.raises(TypeError, match="threads"):
        pinload.patch_safetensors(thread=2)
    assert safetensors.safe_open is REFERENCE["safe_open"]


def comfy_load(ckpt):
    return comfy_utils_copy.load_torch_file(str(ckpt), device=torch.device("cpu"), return_metadata=True)


def test_comfyui_load_torch_file(ckpt):
    """ComfyUI's loader (copy pinned to a commit) under the patch: the reference's tensors and
    metadata, and counts() shows the file went through pinload."""
    want, want_meta = comfy_load(ckpt)
    with pinload.patch_safetensors() as patch:
        got, meta = comfy_load(ckpt)
    assert patch.counts() == {"safetensors.safe_open": 1, "files": 1} and patch.fallbacks == {}
    assert meta == want_meta and meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert list(got) == list(want)
    for k in want:
        assert_same(got[k], want[k], k)


def test_comfyui_custom_node_package(ckpt):
    """examples/comfyui/pinload_loader imported as ComfyUI imports a custom node (a module from the
    package's __init__.py): no nodes, and safetensors goes through pinload from then on."""
    init = REPO / "examples" / "comfyui" / "pinload_loader" / "__init__.py"
    spec = importlib.util.spec_from_file_location("custom_nodes.pinload_loader", str(init))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assert module.NODE_CLASS_MAPPINGS == {} and module.PATCH is not None
        got, _ = comfy_load(ckpt)
        assert module.PATCH.counts() == {"safetensors.safe_open": 1, "files": 1}
    finally:
        module.PATCH.undo()
    want = REFERENCE["load_file"](str(ckpt))
    for k in want:
        assert_same(got[k], want[k], k)


def test_webui_extension_script(ckpt):
    """examples/webui/pinload-webui/scripts/pinload_patch.py, run as the webui runs an extension's
    script, then A1111's two reads (load_file to a device; load of the file's bytes)."""
    script = runpy.run_path(str(REPO / "examples" / "webui" / "pinload-webui" / "scripts" / "pinload_patch.py"))
    patch = script["PATCH"]
    try:
        got = safetensors.torch.load_file(str(ckpt), device="cpu")
        got_bytes = safetensors.torch.load(open(ckpt, "rb").read())
        assert patch.counts() == {"safetensors.torch.load_file": 1, "safetensors.torch.load": 1, "files": 2}
    finally:
        patch.undo()
    want = REFERENCE["load_file"](str(ckpt))
    for k in want:
        assert_same(got[k], want[k], k)
        assert_same(got_bytes[k], want[k], k)


DIGESTS = """
import hashlib, json, sys
import safetensors.torch
from safetensors import safe_open
sd = safetensors.torch.load_file(sys.argv[1], device="cpu")
with safetensors.safe_open(sys.argv[1], framework="pt", device="cpu") as f:
    meta = f.metadata()
import sitecustomize
print(json.dumps({"digests": {k: hashlib.sha256(v.contiguous().view(-1).view(__import__("torch").uint8).numpy()).hexdigest()
                              for k, v in sd.items()}, "metadata": meta,
                  "counts": sitecustomize.PINLOAD_PATCH.counts(),
                  "by_name_is_pinloads": safe_open is safetensors.safe_open}))
"""


def test_webui_sitecustomize(ckpt):
    """examples/webui/sitecustomize.py first on PYTHONPATH: a fresh Python has the patch before its
    first import of safetensors; even a name imported by name at module import is pinload's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "examples" / "webui"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", DIGESTS, str(ckpt)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    want = REFERENCE["load_file"](str(ckpt))
    assert result["digests"] == {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                                 for k, v in want.items()}
    with REFERENCE["safe_open"](str(ckpt), framework="pt") as ref:
        assert result["metadata"] == ref.metadata()
    # the handle read only the header: one file loaded, by load_file
    assert result["counts"] == {"safetensors.torch.load_file": 1, "safetensors.safe_open": 1, "files": 1}
    assert result["by_name_is_pinloads"]  # imported by name after the patch


def test_a_tensor_pinload_cannot_give_comes_from_the_reference(ckpt, patch, monkeypatch):
    """Where pinload's handle fails a tensor (simulated: every pinload dtype loads today), the
    handle opens the reference once and takes that tensor from it; the others stay pinload's."""
    refused = "denoiser.sigmas"
    real = pinload.torch.safe_open.get_tensor

    def get_tensor(self, name):
        if name == refused:
            raise pinload._core.InvalidFileError(f"{self._path}: tensor '{name}': simulated")
        return real(self, name)

    monkeypatch.setattr(pinload.torch.safe_open, "get_tensor", get_tensor)
    with REFERENCE["safe_open"](str(ckpt), framework="pt") as ref:
        want = {k: ref.get_tensor(k) for k in ref.offset_keys()}
    with safetensors.safe_open(str(ckpt), framework="pt") as f:
        got = f.get_tensors()
        with pytest.raises(Exception, match="does not contain tensor"):
            f.get_tensor("no.such.tensor")  # the reference's wording, not a fallback
    assert list(got) == list(want)
    for k in want:
        assert_same(got[k], want[k], k)
    assert patch.fallbacks == {"safetensors.safe_open.get_tensor": 1}
    assert patch.counts() == {"safetensors.safe_open": 1, "files": 1}
