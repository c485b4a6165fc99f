"""The Env's write faults under the remote object cache (Note [Remote cache]): the cache writes
its .part file, digests and entry through the Env of the load that fills it, so a FaultEnv can
fail each write (open, pwrite, fsync, rename). The pinload_cache_write_faults program loads an
object behind nginx once per fault with an empty cache folder: a failed cache write never fails
the load, the bytes are those an independent reader finds, and nothing is left in the folder;
short, interrupted writes still commit the entry."""

import os
import shutil
import subprocess

import pytest

from test_remote_load import big_file
from test_source_faults import independent_digests


def test_cache_write_faults(nginx, served_root, tmp_path):
    program = os.environ.get("PINLOAD_CACHE_WRITE_FAULTS")
    if not program:
        pytest.skip("PINLOAD_CACHE_WRITE_FAULTS (the pinload_cache_write_faults test program) is set by ctest only")
    model = big_file(tmp_path / "m.safetensors", 1, seed=29)
    shutil.copy(model, served_root / "cache_write_faults.safetensors")
    old = os.path.getmtime(model) - 60  # a settled validator (Note [Remote consistency]): no wait
    os.utime(served_root / "cache_write_faults.safetensors", (old, old))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PINLOAD_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([program, f"{nginx.url}/cache_write_faults.safetensors"], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = proc.stdout.splitlines()
    cases = [line for line in lines if "\t" not in line]
    digests = dict(line.split("\t") for line in lines if "\t" in line)
    assert len(cases) == 6 and all(c.startswith("ok ") for c in cases), proc.stdout + proc.stderr
    assert digests == independent_digests(model), proc.stderr
    assert proc.returncode == 0, proc.stderr
