"""`pinload manifest` and `pinload load --verify / --sha256` (Note [Verified loads] in
include/pinload/manifest.h), against digests computed here with hashlib over the raw file."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from stfiles import write_raw, read_header


def _model(path, seed=3):
    rng = __import__("random").Random(seed)
    tensors = [("small", "U8", [7], bytes(rng.getrandbits(8) for _ in range(7))),
               ("big", "U8", [3 * 2**20 + 5], os.urandom(3 * 2**20 + 5)),
               ("w", "F32", [1000], os.urandom(4000))]
    write_raw(path, tensors, metadata={"format": "pt"}, pad=1)
    return tensors


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_manifest_matches_hashlib(tmp_path, run_pinload):
    path = tmp_path / "model.safetensors"
    _model(path)
    r = run_pinload("manifest", path)
    assert r.returncode == 0, r
    m = json.loads(r.stdout)
    assert m["format"] == "pinload.manifest" and m["version"] == 1 and m["piece_bytes"] == 2**20
    raw = path.read_bytes()
    f = m["files"]["model.safetensors"]
    assert f["size"] == len(raw) and f["sha256"] == hashlib.sha256(raw).hexdigest()
    header, n = read_header(path)
    assert f["data_offset"] == 8 + n and f["metadata"] == {"format": "pt"}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in info["data_offsets"])
        t = f["tensors"][name]
        assert t["range"] == [begin, end] and t["dtype"] == info["dtype"] and t["shape"] == info["shape"]
        assert t["sha256"] == hashlib.sha256(raw[begin:end]).hexdigest()
        if end - begin > 2**20:
            want = [hashlib.sha256(raw[b:min(end, b + 2**20)]).hexdigest() for b in range(begin, end, 2**20)]
            assert t["pieces"] == want
        else:
            assert "pieces" not in t
    out = tmp_path / "m.json"
    assert run_pinload("manifest", "-o", out, path).returncode == 0
    assert json.loads(out.read_text()) == m


@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16"], ["--device", "sim"], ["--direct", "off", "--block-size", "64K"]])
def test_verify_passes_then_names_the_corrupted_tensor(tmp_path, run_pinload, extra):
    path = tmp_path / "model.safetensors"
    _model(path)
    manifest = tmp_path / "m.json"
    assert run_pinload("manifest", "-o", manifest, path).returncode == 0
    r = run_pinload("load", "--no-progress", "--verify", manifest, *extra, path)
    assert r.returncode == 0, r
    begin = json.loads(manifest.read_text())["files"]["model.safetensors"]["tensors"]["big"]["range"][0]
    _flip(path, begin + 2 * 2**20 + 17)
    r = run_pinload("load", "--no-progress", "--digest", "--verify", manifest, *extra, path)
    assert r.returncode == 1, r
    assert r.stdout == ""  # nothing was returned, so nothing was printed
    lo, hi = begin + 2 * 2**20, begin + 3 * 2**20
    assert f"pinload: error: {path}: tensor 'big': the bytes differ from the manifest's" in r.stderr, r
    assert f"(bytes {lo}..{hi})" in r.stderr, r


def test_published_sha256(tmp_path, run_pinload):
    path = tmp_path / "model.safetensors"
    _model(path)
    right = hashlib.sha256(path.read_bytes()).hexdigest()
    wrong = right[:-1] + ("0" if right[-1] != "0" else "1")
    size = path.stat().st_size
    r = run_pinload("load", "--no-progress", "--sha256", f"model.safetensors={right}", path)
    assert r.returncode == 0, r
    r = run_pinload("load", "--no-progress", "--sha256", f"model.safetensors={wrong}", path)
    assert r.returncode == 1 and f"{path}: the file's sha256 is {right}, not the expected {wrong} (bytes 0..{size})" in r.stderr, r
    # A streaming device load cannot check a whole file: it says so instead of skipping it.
    r = run_pinload("load", "--no-progress", "--device", "sim", "--sha256", f"model.safetensors={right}", path)
    assert r.returncode == 1 and "cannot be checked" in r.stderr, r
    # Several PATHs: each load checks the digests of its own files.
    other = tmp_path / "other.safetensors"
    _model(other, seed=5)
    r = run_pinload("load", "--no-progress", "--sha256", f"model.safetensors={right}", path, other)
    assert r.returncode == 0, r
    r = run_pinload("load", "--no-progress", "--sha256", f"model.safetensors={wrong}", other, path)
    assert r.returncode == 1 and "the file's sha256 is" in r.stderr and "other.safetensors:" in r.stderr, r
    r = run_pinload("load", "--no-progress", "--sha256", f"third.safetensors={right}", path, other)
    assert r.returncode == 2 and "no file of any PATH is named 'third.safetensors'" in r.stderr, r
    _flip(path, size - 1)
    r = run_pinload("load", "--no-progress", "--sha256", f"model.safetensors={right}", path)
    assert r.returncode == 1 and "the file's sha256 is" in r.stderr, r


def test_usage_and_bad_manifests(tmp_path, run_pinload):
    path = tmp_path / "model.safetensors"
    _model(path)
    assert run_pinload("load", "--sha256", "nohex", path).returncode == 2
    r = run_pinload("load", "--sha256", "model.safetensors=12", path)
    assert r.returncode == 1 and "64 hex digits" in r.stderr, r
    r = run_pinload("manifest", "s3://bucket/model.safetensors")
    assert r.returncode == 1 and "a manifest is made of local files" in r.stderr, r
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pinload.manifest", "version": 9, "piece_bytes": 2**20, "files": {}}))
    r = run_pinload("load", "--verify", bad, path)
    assert r.returncode == 1 and "manifest version 9 is not supported" in r.stderr, r
    other = tmp_path / "other.safetensors"
    _model(other, seed=4)
    manifest = tmp_path / "m.json"
    assert run_pinload("manifest", "-o", manifest, other).returncode == 0
    r = run_pinload("load", "--verify", manifest, path)
    assert r.returncode == 1 and "not in the manifest" in r.stderr, r


def test_repeatable_options_leave_the_paths_alone(tmp_path, run_pinload):
    """`--sha256 F=H A B` and `--keep P A B` load both A and B: the PATHs after a repeatable option
    are not its values (CLI11 gave them to the option: only B was loaded)."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _model(a, seed=1)
    _model(b, seed=2)
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    for opts in (["--sha256", f"a.safetensors={digest}"], ["--dtype", "bf16", "--keep", "w"]):
        r = run_pinload("load", "--no-progress", *opts, a, b)
        assert r.returncode == 0, r
        assert f"{a}: 3 tensors" in r.stderr and f"{b}: 3 tensors" in r.stderr, r
