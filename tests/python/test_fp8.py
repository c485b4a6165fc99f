"""FP8 storage and dtype conversion on load (include/pinload/convert.h), against torch.

Bit-exactness: every conversion pair, on the host loops and through the stand-in device
("sim", and CUDA when present); NaN compares as NaN (Note [Rounding as torch]), every other
value bit for bit. The converter: names, shapes, skip rules, metadata, the stored FP8 and
scales against torch's formula; loads with dtype= against torch's .to(); bad scales.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import safetensors
import safetensors.torch as st

import pinload
import pinload.torch as pt
from pinload import _core

from pl_helpers import DEVICES, write_raw

FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
WIDE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
CONVERT_DEVICES = ["host", "sim"] + (["cuda:0"] if "cuda" in DEVICES else [])


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)


def _convert(where: str, data: bytes, src: str, dst: str, **kw) -> bytes:
    if where == "host":
        return _core.convert_bytes(data, src, dst, **kw)
    return _core.convert_bytes_on_device(where, data, src, dst, **kw)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-equal, except that a NaN needs only to be a NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"{what}: NaN positions differ"
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    g, w = got.view(width)[~nan], want.view(width)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} values differ, first at {bad[0].item()}: " \
                             f"{g[bad[0]].item():#x} != {w[bad[0]].item():#x}"


def edge_values() -> torch.Tensor:
    """float32 values: random over many magnitudes plus the edge cases."""
    gen = torch.Generator().manual_seed(18)
    parts = [torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-9, 6, (4096,), generator=gen).float()]
    special = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
               1e-40, -1e-40, 1.4e-45,                           # float32 denormals
               6e-8, 5.96e-8, 2.98e-8, 3e-8, 1e-5, -6.1e-5,       # fp16 denormals and the edge
               65504.0, 65519.0, 65520.0, -65520.0, 65536.0,     # fp16 largest, rounding to it / to inf
               3.3895313892515355e38, 3.4e38, -3.4028234663852886e38,  # bf16 largest, float32 largest
               2047.5, 2048.5, 4095.5, 0.99951171875, 1.0009765625]  # halfway cases for fp16
    parts.append(torch.tensor(special, dtype=torch.float32))
    # bf16 halfway and across a power of two, by bit pattern.
    bits = [0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x3FFF8000, 0x3F7F8000, 0x7F7F8000, 0x7F7FFFFF, 0x00008000,
            0x007F8000, 0x80018000, 0x3F800001, 0x477FEFFF, 0x477FF000, 0x387FC000, 0x33800000, 0x337FFFFF]
    parts.append(torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32))
    return torch.cat(parts)


@pytest.mark.parametrize("where", CONVERT_DEVICES)
@pytest.mark.parametrize("src", sorted(FP8))
@pytest.mark.parametrize("dst", sorted(WIDE))
def test_fp8_all_encodings_match_torch(where, src, dst):
    codes = bytes(range(256))
    x = _from_bytes(codes, FP8[src])
    for scale in (1.0, 0.0123, 3.5):
        got = _from_bytes(_convert(where, codes, src, dst, scale=scale), WIDE[dst])
        want = (x.to(torch.float32) * torch.tensor(scale, dtype=torch.float32)).to(WIDE[dst])
        assert_bits(got, want, f"{src}->{dst} scale {scale}")
        if dst == "BF16":  # ComfyUI's dequantisation spelling: same bits
            assert_bits(got, x.to(torch.bfloat16) * torch.tensor(scale, dtype=torch.float32), "comfy form")
    # Long runs take the table (and AVX-512 VBMI) loops: every code at every position mod 64, plus a tail.
    gen = torch.Generator().manual_seed(3)
    long = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(65), torch.randint(0, 256, (77,), generator=gen,
                                                                                      dtype=torch.uint8)])
    got = _from_bytes(_convert(where, _bytes(long), src, dst, scale=0.75), WIDE[dst])
    assert_bits(got, (long.view(FP8[src]).to(torch.float32) * 0.75).to(WIDE[dst]), f"{src}->{dst} long")


@pytest.mark.parametrize("where", CONVERT_DEVICES)
@pytest.mark.parametrize("src", sorted(WIDE))
@pytest.mark.parametrize("dst", sorted(WIDE))
def test_16_32_pairs_match_torch(where, src, dst):
    x = edge_values().to(WIDE[src])
    got = _from_bytes(_convert(where, _bytes(x), src, dst), WIDE[dst])
    assert_bits(got, x.to(WIDE[dst]), f"{src}->{dst}")


# Runs of at least 256 KiB of output take the non-temporal store paths (Note [Streaming stores] in
# src/format/dtype_convert.cc): tiles streamed out, and the VBMI loop streaming from an aligned point.
@pytest.mark.parametrize("where", CONVERT_DEVICES)
@pytest.mark.parametrize("src", sorted(FP8) + sorted(WIDE))
@pytest.mark.parametrize("dst", sorted(WIDE))
def test_streamed_long_runs_match_torch(where, src, dst):
    gen = torch.Generator().manual_seed(7)
    if src in FP8:
        x = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(600),
                       torch.randint(0, 256, (4099,), generator=gen, dtype=torch.uint8)]).view(FP8[src])
        scale = 0.375
    else:
        x = edge_values().repeat(40)[: 160_000 + 3].to(WIDE[src])
        scale = 1.0
    kw = {"scale": scale} if src in FP8 else {}
    got = _from_bytes(_convert(where, _bytes(x), src, dst, **kw), WIDE[dst])
    want = (x.to(torch.float32) * scale).to(WIDE[dst]) if src in FP8 else x.to(WIDE[dst])
    assert_bits(got, want, f"{src}->{dst} streamed")


@pytest.mark.parametrize("where", CONVERT_DEVICES)
def test_fp8_per_row_scales_match_torch(where):
    gen = torch.Generator().manual_seed(1)
    rows, cols = 7, 33
    q = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, 1, generator=gen) * 0.1
    got = _from_bytes(_convert(where, _bytes(q), "F8_E4M3", "BF16", row_scales=_bytes(scales), row_elements=cols),
                      torch.bfloat16).reshape(rows, cols)
    want = (q.view(torch.float8_e4m3fn).to(torch.float32) * scales).to(torch.bfloat16)
    assert_bits(got, want, "per row")


@pytest.mark.parametrize("src", sorted(WIDE))
@pytest.mark.parametrize("dst", sorted(FP8))
def test_quantize_matches_torch_formula(src, dst):
    x = edge_values()
    x = x[~torch.isinf(x)].to(WIDE[src])
    m = 448.0 if dst == "F8_E4M3" else 57344.0
    for scale in (1.0, 1e-3, 7.25):
        got = _from_bytes(_core.quantize_bytes(_bytes(x), src, dst, scale=scale), FP8[dst])
        want = (x.float() / torch.tensor(scale)).clamp(-m, m).to(FP8[dst])
        assert_bits(got, want, f"{src}->{dst} scale {scale}")


# ---- the converter ----


def _model(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(dtype)  # noqa: E731
    return {
        "blocks.0.attn.to_q.weight": r(64, 96),
        "blocks.0.attn.to_q.bias": r(64),
        "blocks.0.ff.net.weight": (torch.randn(128, 64, generator=g) * 3).to(dtype),
        "blocks.0.norm1.linear.weight": r(32, 64),      # a norm's part: kept
        "embed_tokens.weight": r(100, 64),              # an embedding: kept
        "blocks.0.conv.weight": r(8, 4, 3, 3),          # 4-D: kept
        "proj_out.weight": r(16, 64),
        "zeros.weight": torch.zeros(8, 8, dtype=dtype),  # amax 0: scale 1
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _layer(name: str) -> str:
    return name[: -len(".weight")]


QUANTISED = {"blocks.0.attn.to_q.weight", "blocks.0.ff.net.weight", "proj_out.weight", "zeros.weight"}


def _expected_fp8(w: torch.Tensor, fmt: torch.dtype, per_row: bool):
    m = torch.finfo(fmt).max
    amax = w.float().abs().amax(dim=1, keepdim=True) if per_row else w.float().abs().amax()
    scale = torch.where(amax > 0, amax / m, torch.ones_like(amax))
    return (w.float() / scale).clamp(-m, m).to(fmt), scale


@pytest.mark.parametrize("to,fmt", [("fp8-e4m3fn", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("per_row", [False, True])
def test_convert_file_layout_and_values(tmp_path, to, fmt, per_row):
    src = _model()
    st.save_file(src, str(tmp_path / "in.safetensors"), metadata={"format": "pt", "origin": "test"})
    out = tmp_path / "out.safetensors"
    stats = pinload.convert(tmp_path / "in.safetensors", out, to=to, scale="per-row" if per_row else "per-tensor",
                            keep=["proj_out"])
    quantised = QUANTISED - {"proj_out.weight"}
    assert stats["tensors_quantized"] == len(quantised) and stats["files"] == 1
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0, "data section starts at a multiple of 4096"
    header = json.loads(raw[8:8 + n])
    begins = sorted(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert begins[0] == 0
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
        got = {k: f.get_tensor(k) for k in names}
    assert meta["format"] == "pt" and meta["origin"] == "test"
    qmeta = json.loads(meta["_quantization_metadata"])
    fmt_name = "float8_e4m3fn" if fmt == torch.float8_e4m3fn else "float8_e5m2"
    assert qmeta == {"format_version": "1.0", "layers": {_layer(k): {"format": fmt_name} for k in sorted(quantised)}}
    extra = {_layer(k) + s for k in quantised for s in (".weight_scale", ".comfy_quant")}
    assert names == set(src) | extra
    for k, w in src.items():
        if k not in quantised:
            assert got[k].dtype == w.dtype and torch.equal(got[k], w), k
            continue
        want_q, want_scale = _expected_fp8(w, fmt, per_row)
        assert got[k].dtype == fmt and got[k].shape == w.shape
        assert_bits(got[k], want_q, k)
        scale = got[_layer(k) + ".weight_scale"]
        assert scale.dtype == torch.float32
        assert scale.shape == ((w.shape[0], 1) if per_row else ())
        assert torch.equal(scale, want_scale.reshape(scale.shape))
        assert json.loads(bytes(got[_layer(k) + ".comfy_quant"].tolist())) == {"format": fmt_name}
        # Dequantised as ComfyUI does, and as a dtype=bf16 load must.
        deq = got[k].to(torch.bfloat16) * scale
        assert_bits(deq, want_q.to(torch.bfloat16) * want_scale, k + " dequantised")


def test_large_tensors_are_4096_aligned(tmp_path):
    src = {f"layers.{i}.weight": torch.randn(64, 64 + i).to(torch.bfloat16) for i in range(3)}
    src.update({f"big.{i}.weight": torch.randn(256, 256).to(torch.bfloat16) for i in range(3)})
    st.save_file(src, str(tmp_path / "in.safetensors"))
    pinload.convert(tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    raw = (tmp_path / "out.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for i in range(3):
        assert (8 + n + header[f"big.{i}.weight"]["data_offsets"][0]) % 4096 == 0


def test_convert_sharded_folder_rewrites_index(tmp_path):
    from pl_helpers import write_sharded

    src = _model()
    folder = tmp_path / "model"
    index = write_sharded(folder, src, shards=2)
    (folder / "config.json").write_text('{"a": 1}')
    out = tmp_path / "model-fp8"
    pinload.convert(folder, out)
    assert (out / "config.json").read_text() == '{"a": 1}'
    new_index = json.loads((out / index.name).read_text())
    weight_map = new_index["weight_map"]
    for k in QUANTISED:
        assert weight_map[_layer(k) + ".weight_scale"] == weight_map[k]
        assert weight_map[_layer(k) + ".comfy_quant"] == weight_map[k]
    total = 0
    for shard in set(weight_map.values()):
        with safetensors.safe_open(str(out / shard), "pt") as f:
            for k in f.keys():
                assert weight_map[k] == shard, k
        raw = (out / shard).read_bytes()
        total += len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    assert new_index["metadata"]["total_size"] == total
    # Loaded back through the index in bf16: the original names, dequantised.
    sd = pt.load_files(out / index.name, dtype=torch.bfloat16)
    assert set(sd) == set(src)


def test_existing_output_folder_refused(tmp_path):
    from pl_helpers import write_sharded

    write_sharded(tmp_path / "m", _model(), shards=2)
    (tmp_path / "out").mkdir()
    with pytest.raises(pinload.InvalidFileError):
        pinload.convert(tmp_path / "m", tmp_path / "out")


def test_killed_convert_leaves_no_output(tmp_path):
    big = {f"l.{i}.weight": torch.randn(1024, 1024).to(torch.bfloat16) for i in range(16)}  # 32 MiB
    st.save_file(big, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    code = ("import sys, pinload; pinload.convert(sys.argv[1], sys.argv[2], threads=1)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "in.safetensors"), str(out)],
                            env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".out.safetensors.pinload-tmp-") for p in tmp_path.iterdir()):
        assert proc.poll() is None, "convert ended before its temporary appeared"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed convert left an output file"
    # The next convert of the same target removes the stale temporary and completes.
    pinload.convert(tmp_path / "in.safetensors", out)
    assert out.exists()
    assert not [p for p in tmp_path.iterdir() if ".pinload-tmp-" in p.name]


# ---- loads with dtype ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_row", [False, True])
def test_load_fp8_as_bf16_matches_torch(tmp_path, device, per_row):
    src = _model(torch.float32)
    st.save_file(src, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    pinload.convert(tmp_path / "in.safetensors", out, scale="per-row" if per_row else "per-tensor")
    stored = st.load_file(str(out))
    sd = pt.load_file(out, device=device, dtype=torch.bfloat16)
    assert set(sd) == set(src), "scales and markers are not handed out"
    for k, w in src.items():
        t = sd[k].cpu()
        if k in QUANTISED:
            scale = stored[_layer(k) + ".weight_scale"]
            want = (stored[k].to(torch.float32) * scale).to(torch.bfloat16)
        elif w.is_floating_point():
            want = w.to(torch.bfloat16)
        else:
            want = w
        assert_bits(t, want, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16])
def test_load_fp32_as_16bit_across_chunks(tmp_path, device, dst):
    # Elements that straddle 4 KiB chunk boundaries: a 3-byte tensor first, then F32 at odd offsets.
    x = edge_values()
    y = torch.randn(3000)
    path = write_raw(tmp_path / "odd.safetensors", [
        ("pad", "U8", [3], b"abc"),
        ("x", "F32", [x.numel()], _bytes(x)),
        ("h", "BF16", [1001], _bytes(torch.randn(1001).to(torch.bfloat16))),
        ("y", "F32", [30, 100], _bytes(y)),
    ])
    sd = pt.load_file(path, device=device, dtype=dst, block_size=4096)
    ref = st.load_file(str(path))
    assert torch.equal(sd["pad"].cpu(), ref["pad"])
    for k in ("x", "h", "y"):
        assert_bits(sd[k].cpu(), ref[k].to(dst), k)


@pytest.mark.parametrize("device", DEVICES)
def test_keep_patterns_and_keep_dtype(tmp_path, device):
    src = {"a.time_embed.weight": torch.randn(4, 4), "a.lin.weight": torch.randn(4, 4),
           "time_embedding.weight": torch.randn(4, 4)}
    st.save_file(src, str(tmp_path / "f.safetensors"))
    sd = pt.load_file(tmp_path / "f.safetensors", device=device, dtype=torch.bfloat16, keep=["time_embed"])
    assert sd["a.time_embed.weight"].dtype == torch.float32
    assert sd["a.lin.weight"].dtype == torch.bfloat16
    assert sd["time_embedding.weight"].dtype == torch.bfloat16  # whole dotted parts only
    sd = pt.load_file(tmp_path / "f.safetensors", device=device, dtype=torch.float16, keep=["*.lin.*"],
                      keep_dtype=torch.bfloat16)
    assert sd["a.lin.weight"].dtype == torch.bfloat16 and sd["a.time_embed.weight"].dtype == torch.float16


def _fp8_file(tmp_path, scale_dtype="F32", scale_shape=(), with_scale=True, marker=True):
    q = bytes(range(64))
    tensors = [("l.weight", "F8_E4M3", [8, 8], q)]
    if with_scale:
        n = 1
        for d in scale_shape:
            n *= d
        size = {"F32": 4, "BF16": 2, "F16": 2}[scale_dtype]
        tensors.append(("l.weight_scale", scale_dtype, list(scale_shape), b"\0" * (n * size)))
    if marker:
        m = b'{"format": "float8_e4m3fn"}'
        tensors.append(("l.comfy_quant", "U8", [len(m)], m))
    return write_raw(tmp_path / "bad.safetensors", tensors)


@pytest.mark.parametrize("case,kw,words", [
    ("wrong shape", dict(scale_shape=(3,)), "shape"),
    ("missing", dict(with_scale=False), "no scale"),
    ("not float32", dict(scale_dtype="BF16"), "F32"),
])
def test_bad_scales_raise_typed_errors(tmp_path, case, kw, words):
    path = _fp8_file(tmp_path, **kw)
    with pytest.raises(pinload.InvalidFileError) as e:
        pt.load_file(path, dtype=torch.bfloat16)
    assert words in str(e.value), case
    assert e.value.tensor in ("l.weight", "l.weight_scale"), case


def test_fp8_without_marker_or_scale_is_a_plain_cast(tmp_path):
    path = _fp8_file(tmp_path, with_scale=False, marker=False)
    sd = pt.load_file(path, dtype=torch.float32)
    want = _from_bytes(bytes(range(64)), torch.float8_e4m3fn).reshape(8, 8).to(torch.float32)
    assert_bits(sd["l.weight"], want, "plain cast")


def test_keep_without_dtype_is_refused(tmp_path, small_file):
    path, _ = small_file
    with pytest.raises(ValueError):
        pt.load_file(path, keep=["w"])
