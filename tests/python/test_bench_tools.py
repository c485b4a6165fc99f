"""The benchmark tools' own checks: file resolution, verification of a system's result
(a wrong byte, a missing tensor and a lazy map must all fail), worker processes, and the
SDXL generator's real-class shapes. bench/ and scripts/ are not a package: imported by path."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from peers import checkpoint as ck, harness, worker  # noqa: E402


def _save(path, tensors):
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path)


@pytest.fixture
def pipeline(tmp_path):
    """A pipeline folder whose two components share tensor names (as SDXL's text encoders)
    and are saved as an fp16 variant only, plus a non-variant file that must be ignored."""
    (tmp_path / "model_index.json").write_text("{}")
    g = torch.Generator().manual_seed(0)
    files = []
    for comp in ("text_encoder", "text_encoder_2"):
        d = tmp_path / comp
        d.mkdir()
        t = {"text_model.a": torch.randn(64, 64, generator=g).half(), "text_model.b": torch.randn(7, generator=g).half()}
        files.append(_save(d / "model.fp16.safetensors", t))
    _save(tmp_path / "text_encoder" / "model.safetensors", {"text_model.a": torch.zeros(2)})
    return tmp_path, files


def test_resolve_prefers_the_variant(pipeline):
    root, files = pipeline
    assert ck.resolve([str(root)], "fp16") == files


def test_batches_split_clashing_names(pipeline):
    _, files = pipeline
    assert ck.batches_without_clashes(files) == [[0], [1]]


def test_verify_accepts_the_right_bytes_and_rejects_wrong_ones(pipeline):
    _, files = pipeline
    ref = ck.reference_digests(files)
    good = {}
    for i, p in enumerate(files):
        for k, v in st.load_file(p).items():
            good[f"{i}/{k}"] = v.clone()
    assert worker.verify(good, files, ref)["ok"]

    bad = dict(good)
    t = bad["1/text_model.a"].clone()
    t.view(torch.uint8)[5] ^= 1  # one bit of one byte
    bad["1/text_model.a"] = t
    v = worker.verify(bad, files, ref)
    assert not v["ok"] and v["digest_mismatch"] == ["1/text_model.a"]

    short = dict(good)
    del short["0/text_model.b"]
    assert not worker.verify(short, files, ref)["ok"]


def test_reference_digest_is_of_the_file_bytes(pipeline):
    _, files = pipeline
    start, h = ck.header(files[0])
    b, e = h["text_model.a"]["data_offsets"]
    with open(files[0], "rb") as f:
        f.seek(start + b)
        want = hashlib.sha1(f.read(e - b)).hexdigest()
    assert ck.reference_digests(files)["0/text_model.a"] == want


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    # large enough that 90% of it cannot become resident by accident
    p = tmp_path_factory.mktemp("big") / "big.safetensors"
    g = torch.Generator().manual_seed(1)
    return _save(p, {f"w{i}": torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, generator=g) for i in range(8)})


def _step(files):
    return {"paths": files, "files": files, "digests": ck.reference_digests(files)}


def test_worker_verifies_a_real_load_and_flags_a_lazy_map(big_file):
    files = [big_file]
    real = harness.run_system("safetensors mmap + clone", [_step(files)], cold=False)
    assert "error" not in real, real.get("traceback")
    s = real["steps"][0]
    assert s["verify"]["ok"] and s["resident"]
    assert real["vmhwm"] >= 64 << 20

    lazy = harness.run_system("safetensors lazy mmap (not a load)", [_step(files)], cold=False)
    s = lazy["steps"][0]
    assert not s["resident"] and not s["verify"]["ok"] and "lazy" in s["verify"]


def test_worker_records_a_missing_system_as_skipped(big_file):
    r = harness.run_system("tensorizer", [_step([big_file])], cold=False)  # nothing converted
    assert "skipped" in r and "tensorizer" in r["skipped"]


def test_a_scenario_is_data_and_measure_aggregates_its_runs(big_file):
    # A scenario of two steps (a load, then a re-load in the same worker), warm, twice.
    twice = harness.Scenario("warm twice", cold=False, steps=lambda step: [step, dict(step, label="again")])
    rec = harness.measure("safetensors pread", _step([big_file]), (twice,), repeat=2)
    assert list(rec) == ["warm twice"]
    runs = rec["warm twice"]["runs"]
    assert len(runs) == 2 and all(r["verify"]["ok"] for r in runs)
    assert rec["warm twice"]["best_gbps"] == max(r["gbps"] for r in runs)
    assert harness.measure("tensorizer", _step([big_file]), (harness.COLD,), repeat=2)["skipped"]


def test_run_peers_command_line(big_file, tmp_path):
    out = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run_peers.py"), big_file, "--repeat", "1",
                        "--peers", "safetensors pread,tensorizer", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "safetensors pread" in r.stdout and "cold" in r.stdout and "tensorizer" in r.stdout
    peers = json.loads(out.read_text())["peers"]
    assert peers["safetensors pread"]["cold"]["runs"][0]["verify"]["ok"]
    assert "skipped" in peers["tensorizer"]


def test_sdxl_generator_uses_the_real_classes():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import gen_checkpoints as g
    comps = {c.key: c for c in g.sdxl_components("small")}
    unet = comps["sdxl-unet"]
    names = {t.name for t in unet.tensors}
    assert "add_embedding.linear_1.weight" in names  # SDXL's text_time embedding
    assert all(t.dtype == "F16" for t in unet.tensors)
    assert comps["sdxl-clip-l"].tensors[0].name.startswith("text_model.")
    assert "text_projection.weight" in {t.name for t in comps["sdxl-clip-g"].tensors}
    assert g.shard_name(unet, 0, 1) == "diffusion_pytorch_model.fp16.safetensors"
