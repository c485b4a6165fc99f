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
