"""`pinload convert` and `pinload load --dtype` against torch (the formula) and safetensors."""

import hashlib
import json

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


def _digests(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        name, dtype, shape, digest = line.split("\t")
        rows[name] = (dtype, shape, digest)
    return rows


def test_convert_then_load_as_bf16(tmp_path, run_pinload):
    g = torch.Generator().manual_seed(0)
    src = {"blocks.0.to_q.weight": torch.randn(32, 48, generator=g).to(torch.bfloat16),
           "blocks.0.to_q.bias": torch.randn(32, generator=g).to(torch.bfloat16),
           "blocks.0.norm.weight": torch.randn(8, 8, generator=g)}
    st.save_file(src, str(tmp_path / "in.safetensors"))
    r = run_pinload("convert", "--scale", "per-row", "-v", tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert r.returncode == 0, r
    assert "1 tensors quantised" in r.stderr
    stored = st.load_file(str(tmp_path / "out.safetensors"))
    assert stored["blocks.0.to_q.weight"].dtype == torch.float8_e4m3fn
    assert stored["blocks.0.to_q.weight_scale"].shape == (32, 1)
    r = run_pinload("load", "--digest", "--dtype", "bf16", tmp_path / "out.safetensors")
    assert r.returncode == 0, r
    rows = _digests(r.stdout)
    assert set(rows) == set(src)
    want = (stored["blocks.0.to_q.weight"].float() * stored["blocks.0.to_q.weight_scale"]).to(torch.bfloat16)
    assert rows["blocks.0.to_q.weight"] == ("BF16", "[32,48]", hashlib.sha256(want.view(torch.uint8).numpy()).hexdigest())
    norm = src["blocks.0.norm.weight"].to(torch.bfloat16)
    assert rows["blocks.0.norm.weight"][2] == hashlib.sha256(norm.view(torch.uint8).numpy()).hexdigest()
    r = run_pinload("load", "--digest", "--dtype", "bf16", "--keep", "norm", tmp_path / "out.safetensors")
    assert _digests(r.stdout)["blocks.0.norm.weight"][0] == "F32"


def test_convert_usage_and_errors(tmp_path, run_pinload):
    assert run_pinload("convert", "only-one").returncode == 2
    assert run_pinload("convert", "--to", "int4", "a", "b").returncode == 2
    r = run_pinload("convert", tmp_path / "missing.safetensors", tmp_path / "o.safetensors")
    assert r.returncode == 1 and "pinload: error:" in r.stderr
    assert run_pinload("load", "--dtype", "int8", tmp_path / "x").returncode == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("to", ["fp8-e4m3fn", "fp8-e5m2"])
def test_convert_refuses_an_infinite_weight_and_keeps_it_on_request(tmp_path, run_pinload, dtype, to):
    """One inf made the scale inf and every dequantised value non-finite, with exit 0 (Note
    [Infinite weights] in src/convert/convert.cc). NaN is representable and passes through."""
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    w[3, 5] = float("inf")
    w[0, 1] = float("nan")
    ok = torch.randn(16, 32).to(dtype)
    ok[2, 2] = float("nan")
    st.save_file({"a.weight": ok, "b.weight": w}, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    r = run_pinload("convert", "--to", to, tmp_path / "in.safetensors", out)
    assert r.returncode == 1, r
    assert "b.weight" in r.stderr and "element 101 is infinite" in r.stderr and "--keep b.weight" in r.stderr, r
    with open(tmp_path / "in.safetensors", "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(header_len))
    esize = w.element_size()
    at = 8 + header_len + meta["b.weight"]["data_offsets"][0] + 101 * esize
    assert f"(bytes {at}..{at + esize})" in r.stderr, r
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["in.safetensors"]
    r = run_pinload("convert", "--to", to, "--keep", "b.weight", tmp_path / "in.safetensors", out)
    assert r.returncode == 0, r
    got = st.load_file(str(out))
    assert torch.equal(got["b.weight"].view(torch.uint8), w.view(torch.uint8))  # kept as stored
    q = got["a.weight"].float() * got["a.weight_scale"]
    assert torch.isnan(q[2, 2]) and torch.isfinite(q).sum() == q.numel() - 1


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_convert_leaves_nothing_behind(tmp_path, pinload_bin, sig):
    """SIGINT and SIGTERM left the temporary output (`.NAME.pinload-tmp-PID`) of its full size."""
    import os
    import signal
    import subprocess
    import time

    src = tmp_path / "in.safetensors"
    st.save_file({f"w{i}": torch.ones(2048, 4096) for i in range(12)}, str(src))  # 384 MiB of fp32
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([pinload_bin, "convert", "--threads", "1", src, out_dir / "o.safetensors"],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not any(out_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert proc.poll() is None, "the conversion ended before it could be interrupted"
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -getattr(signal, sig), (proc.returncode, err)  # ends by the signal, as before
    assert list(out_dir.iterdir()) == [], list(out_dir.iterdir())


@pytest.mark.parametrize("rows", [4, 512], ids=["tiny", "larger"])
def test_convert_reports_the_sizes_and_ratio_it_wrote(tmp_path, run_pinload, rows):
    """The summary's sizes are the files' and its ratio is output / input; a tiny file, whose header
    grows by more than FP8 saves, is reported as larger, not as an "x" of compression."""
    import os
    import re

    src = {"blocks.0.to_q.weight": torch.randn(rows, 64).to(torch.bfloat16)}
    st.save_file(src, str(tmp_path / "in.safetensors"))
    r = run_pinload("convert", "-v", tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert r.returncode == 0, r
    size_in = os.path.getsize(tmp_path / "in.safetensors")
    size_out = os.path.getsize(tmp_path / "out.safetensors")
    m = re.search(r"; (\S+ \S+) -> (\S+ \S+) \(([0-9.]+) x the input(.*?)\) in ", r.stderr)
    assert m, r.stderr

    def parse(text):
        value, unit = text.split()
        return float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]

    assert parse(m[1]) == pytest.approx(size_in, rel=0.01, abs=1)
    assert parse(m[2]) == pytest.approx(size_out, rel=0.01, abs=1)
    assert float(m[3]) == pytest.approx(size_out / size_in, abs=0.001)
    assert ("larger" in m[4]) == (size_out > size_in), r.stderr
    if rows == 512:
        assert size_out < size_in
