"""Zero-copy host loads (Note [Zero-copy loads]): a fresh process's load_file of a cached file hands out
views of a leased file mapping, with safetensors' bytes, and survives another process truncating the file.

Each case runs in a fresh interpreter (what a new worker gets), so that a crash shows as a failure."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import safetensors.torch as st

import pinload.torch as pt


@pytest.fixture
def model_file(tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors = {f"blocks.{i}.weight": torch.randn(256, 257, generator=gen).to(torch.float16) for i in range(6)}
    tensors["norm.weight"] = torch.randn(4097, generator=gen, dtype=torch.float32)
    tensors["ids"] = torch.arange(11)
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def run_fresh(code: str, *args: str) -> str:
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_fresh_process_load_is_zero_copy_and_equal_to_safetensors(model_file):
    out = run_fresh("""
        import sys, torch, safetensors.torch as st
        import pinload._core as core, pinload.torch as pt
        path = sys.argv[1]
        ref = st.load(open(path, "rb").read())
        h = core.load_async([path.encode()], "cpu", threads=2)
        h.result()
        print("zero_copy", h.progress()["files_zero_copy"])
        got = pt.load_file(path)
        assert sorted(got) == sorted(ref), (list(got), list(ref))
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
        got["ids"][0] = 99  # copy-on-write: the file keeps its bytes
        assert st.load(open(path, "rb").read())["ids"][0] == 0
        print("ok")
    """, str(model_file))
    assert "zero_copy 1" in out and "ok" in out


def test_zero_copy_off_reads_into_the_pool(model_file):
    out = run_fresh("""
        import sys, pinload._core as core
        h = core.load_async([sys.argv[1].encode()], "cpu", zero_copy="off")
        h.result()
        print("zero_copy", h.progress()["files_zero_copy"])
    """, str(model_file))
    assert "zero_copy 0" in out


def test_truncation_by_another_process_keeps_the_loaded_bytes(model_file):
    out = run_fresh("""
        import os, subprocess, sys, torch, safetensors.torch as st
        import pinload.torch as pt
        path = sys.argv[1]
        ref = st.load(open(path, "rb").read())  # an independent copy of the version loaded
        got = pt.load_file(path, zero_copy="on")
        # truncate(1) opens with O_NONBLOCK: the lease break starts, it fails with EAGAIN until the
        # tensors have been moved out, then succeeds.
        import time
        for attempt in range(200):
            if subprocess.run(["truncate", "-s", "0", path], timeout=60).returncode == 0:
                break
            time.sleep(0.05)
        assert os.path.getsize(path) == 0
        for k in ref:
            assert torch.equal(got[k], ref[k]), k  # touching every byte: no SIGBUS
        print("ok")
    """, str(model_file))
    assert "ok" in out


def test_bad_zero_copy_value_is_rejected(model_file):
    with pytest.raises(ValueError, match="zero_copy"):
        pt.load_file(model_file, zero_copy="sometimes")
