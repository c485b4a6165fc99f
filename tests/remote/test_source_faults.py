"""The byte-source fault table (tests/support/source_faults.h) on remote
objects: the same cases that tests/unit/source_faults_test.cc runs on local files
read direct, buffered and mapped, here on an object behind nginx, on one in
SeaweedFS (S3), and on one through the object cache. Each case injects its
fault into the source the load opens (LoadOptions::wrap_source): a failed
load must be the typed error of the failed read (file and range), return
nothing and leave no descriptor, thread or pool block; a clean one must hold
the bytes an independent reader finds."""

import hashlib
import os
import shutil
import subprocess

import pytest

import stfiles
from conftest import BUCKET
from test_remote_load import big_file


def independent_digests(path):
    """name -> SHA-256 of its bytes, from the header text and a plain read."""
    header, n = stfiles.read_header(path)
    raw = path.read_bytes()
    begin = 8 + n
    return {name: hashlib.sha256(raw[begin + info["data_offsets"][0]:begin + info["data_offsets"][1]]).hexdigest()
            for name, info in header.items() if name != "__metadata__"}


def run_table(url, env=None):
    program = os.environ.get("PINLOAD_SOURCE_FAULTS")
    if not program:
        pytest.skip("PINLOAD_SOURCE_FAULTS (the pinload_source_faults test program) is set by ctest only")
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    full.update(env or {})
    proc = subprocess.run([program, url], capture_output=True, text=True, env=full, timeout=300)
    lines = proc.stdout.splitlines()
    digests = dict(line.split("\t") for line in lines if "\t" in line)
    cases = [line for line in lines if "\t" not in line]
    return proc, digests, cases


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 4 MiB checkpoint: several 256 KiB reads per tensor."""
    return big_file(tmp_path_factory.mktemp("source_faults") / "m.safetensors", 1, seed=23)


def check(proc, digests, cases, model):
    assert digests == independent_digests(model), proc.stderr
    assert cases and all(c.startswith("ok ") for c in cases), proc.stdout + proc.stderr
    # Every row of the table ran, and the failing rows injected their fault.
    assert len(cases) == 6, cases
    for c in cases:
        if "fails" in c:
            assert "(0 faults injected)" not in c, c
    assert proc.returncode == 0, proc.stderr


def test_the_table_over_http(nginx, served_root, model):
    shutil.copy(model, served_root / "source_faults.safetensors")
    url = f"{nginx.url}/source_faults.safetensors"
    proc, digests, cases = run_table(url)
    check(proc, digests, cases, model)
    assert all(c.split()[-1] == url for c in cases if "fails" in c), cases


def test_the_table_over_s3(weed, model):
    weed.client().upload_file(str(model), BUCKET, "source_faults/m.safetensors")
    url = f"s3://{BUCKET}/source_faults/m.safetensors"
    proc, digests, cases = run_table(url, env=weed.env())
    check(proc, digests, cases, model)
    assert all(c.split()[-1] == url for c in cases if "fails" in c), cases


def test_the_table_through_the_object_cache(nginx, served_root, model, tmp_path):
    """Through the write-through cache: the first (warm-up) load fills it, so
    the cases read its copy as a local file, with the fault injected all the same."""
    shutil.copy(model, served_root / "source_faults_cached.safetensors")
    env = {"PINLOAD_CACHE_DIR": str(tmp_path / "cache")}
    proc, digests, cases = run_table(f"{nginx.url}/source_faults_cached.safetensors", env=env)
    check(proc, digests, cases, model)
    # The failed reads were the cached copy's.
    failed = [c for c in cases if "fails" in c]
    assert failed and all(c.split()[-1].startswith(str(tmp_path / "cache") + "/") for c in failed), cases


def test_an_object_that_is_not_a_checkpoint_fails_the_program(nginx, served_root, model):
    """No case runs on an object that is not a checkpoint, and the program says so and exits 1
    (a failing case's verdict is the judge's, tested in tests/unit/source_faults_test.cc)."""
    (served_root / "not_a_checkpoint.safetensors").write_bytes(b"\xff" * 64)
    proc, digests, cases = run_table(f"{nginx.url}/not_a_checkpoint.safetensors")
    assert proc.returncode == 1 and not cases and "pinload_source_faults" in proc.stderr, proc
