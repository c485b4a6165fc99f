"""The encoder at every stored dtype x every serving dtype (``--dtype``), for a FLUX-shaped T5 and a
CLIP with realistic weights: the parameters are those ``from_pretrained(dtype=...)`` gives (dtypes
and bytes, T5's ``wo`` kept in float32 at float16: Note [Modules kept in float32] in
encoder/model.py), and the embeddings equal local encoding with transformers bit for bit. A server
serves the bf16 T5 of scripts/gen_checkpoints.py's flux-dev-small (FLUX's and SD3's T5s ship in
bf16)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny_models
from conftest import Server
from pinload.encoder import EncoderClient
from pinload.encoder.model import EncodeSpec, Encoder

REPO = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROMPTS = ["a cat", "a photo of a cat sitting on a red chair in the sun", "dog",
           "an oil painting of a lighthouse on a cliff at night with stars"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(kind, stored dtype) -> model folder: the same weights stored in each dtype."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for name, dtype in DTYPES.items():
        out["t5", name] = tiny_models.make_flux_t5(root / f"t5_{name}", dtype=dtype)
        out["clip", name] = tiny_models.make_clip(root / f"clip_{name}", dtype=dtype, realistic=True)
    return out


def local(kind, path, dtype):
    """The reference: transformers alone, as a pipeline or a local encoder loads it."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    cls = T5EncoderModel if kind == "t5" else CLIPTextModel
    return cls.from_pretrained(str(path), dtype=dtype).eval(), AutoTokenizer.from_pretrained(str(path))


def local_encode(model, tok, prompts, max_length, longest=False):
    enc = tok(prompts, padding="longest" if longest else "max_length", max_length=max_length, truncation=True,
              return_tensors="pt")
    with torch.inference_mode():
        out = model(enc.input_ids, attention_mask=enc.attention_mask if longest else None)
    return out.last_hidden_state, enc.attention_mask


@pytest.mark.parametrize("serve", list(DTYPES))
@pytest.mark.parametrize("store", list(DTYPES))
@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_every_stored_dtype_at_every_dtype(stored, kind, store, serve):
    path = stored[kind, store]
    enc = Encoder.load(str(path), dtype=serve)
    ref, tok = local(kind, path, DTYPES[serve])
    assert enc.load_path == "skip_init" and enc.dtype == str(DTYPES[serve]).removeprefix("torch.")
    got_sd, ref_sd = enc.model.state_dict(), ref.state_dict()
    assert sorted(got_sd) == sorted(ref_sd)
    for name, t in ref_sd.items():  # from_pretrained's dtypes, and the same rounding
        assert same_bytes(got_sd[name], t), (name, got_sd[name].dtype, t.dtype)
    if kind == "t5":
        wo = enc.model.encoder.block[0].layer[1].DenseReluDense.wo.weight
        assert wo.dtype == (torch.float32 if serve == "fp16" else DTYPES[serve])
    for longest in (False, True):
        want, mask = local_encode(ref, tok, PROMPTS, 24, longest)
        got = enc.encode(PROMPTS, EncodeSpec(max_length=24, padding="longest" if longest else "max_length"))
        assert bool(torch.isfinite(want).all()) and float(want.float().abs().max()) > 0
        for i, g in enumerate(got):
            n = int(mask[i].sum()) if longest else 24
            assert same_bytes(g["embeddings"], want[i, :n]), (i, float((g["embeddings"] - want[i, :n]).abs().max()))
            assert torch.equal(g["attention_mask"], mask[i, :n].to(torch.int64))


@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_lower_precision_stays_close_to_fp32(stored, kind):
    """Another dtype path, so no bit equality: bf16 and fp16 (stored and served) stay within a
    stated tolerance of the fp32 model's encoding, relative to its largest magnitude: 5e-2 for
    bf16 (8 significant bits), 5e-3 for fp16 (11)."""
    ref, tok = local(kind, stored[kind, "fp32"], torch.float32)
    want, _ = local_encode(ref, tok, PROMPTS, 24)
    scale = float(want.abs().max())
    for name, tol in (("bf16", 5e-2), ("fp16", 5e-3)):
        got = Encoder.load(str(stored[kind, name]), dtype=name).encode(PROMPTS, EncodeSpec(max_length=24))
        diff = float((torch.stack([g["embeddings"] for g in got]).float() - want).abs().max())
        assert diff <= tol * scale, (name, diff, scale)


@pytest.fixture(scope="module")
def flux_small(tmp_path_factory):
    """scripts/gen_checkpoints.py's flux-dev-small, its T5 and tokenizer only (bf16)."""
    out = tmp_path_factory.mktemp("gen")
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_checkpoints.py"), "--scale", "small",
                    "--only", "t5-xxl", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    root = out / "flux-dev-small"
    assert (root / "text_encoder_2" / "config.json").is_file() and (root / "tokenizer_2").is_dir()
    return root


@pytest.fixture(scope="module", autouse=True)
def flux_server(flux_small, tmp_path_factory):
    """``pinload encoder serve --model <flux-dev-small> --dtype bf16``, started with the module (its
    start-up overlaps the tests in process); the test waits for it to be ready."""
    server = Server(tmp_path_factory.mktemp("server"), "--model", str(flux_small), "--dtype", "bf16").start()
    try:
        yield server
    finally:
        server.stop()


def test_server_serves_flux_dev_small_bf16_t5(flux_server, flux_small):
    """FLUX's T5 ships in bf16: served at --dtype bf16, the embeddings are local encoding's, bytes."""
    from transformers import AutoTokenizer, T5EncoderModel

    ref = T5EncoderModel.from_pretrained(str(flux_small / "text_encoder_2"), dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(str(flux_small / "tokenizer_2"))
    want, mask = local_encode(ref, tok, PROMPTS, 64)
    out = EncoderClient(flux_server.wait_ready().url).encode(PROMPTS, max_length=64)
    assert out.embeddings.shape == (4, 64, ref.config.d_model) and out.metadata["dtype"] == "bfloat16"
    assert bool(torch.isfinite(want).all())
    assert same_bytes(out.embeddings, want) and torch.equal(out.attention_mask, mask.to(torch.int64))
