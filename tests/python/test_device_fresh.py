"""A fresh process's device loads (Note [Device loads from Python] in src/python/handles.cc), on the
stand-in device "sim": by default they stream through one shared staging pool, so the only new host
memory is that staging (pinned once, reused by every later load), never a pinned copy of the model;
the bytes equal safetensors'. A prefetch still reads the whole model ahead into the device's pool.

Each case runs in a fresh interpreter: what a new worker gets."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch  # noqa: F401  (SMALL_FILE_BYTES)

from pl_helpers import DEVICES

pytestmark = pytest.mark.skipif("sim" not in DEVICES, reason="no sim device")


@pytest.fixture
def files(tmp_path):
    gen = torch.Generator().manual_seed(11)
    out = []
    # one file above pinload.torch.SMALL_FILE_BYTES (a load on its own thread), two below it
    # (loads on the calling thread)
    for name, rows in (("small_a", 64), ("big", 2100), ("small_b", 96)):
        tensors = {f"blocks.{i}.weight": torch.randn(rows, 4096, generator=gen).to(torch.bfloat16) for i in range(8)}
        tensors["norm.weight"] = torch.randn(4097, generator=gen)
        path = tmp_path / f"{name}.safetensors"
        st.save_file(tensors, str(path))
        out.append(path)
    return out


def run_fresh(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_fresh_device_loads_stream_through_one_reused_staging_pool(files):
    assert os.path.getsize(files[1]) > pinload.torch.SMALL_FILE_BYTES > os.path.getsize(files[0])
    out = run_fresh("""
        import json, sys, torch, safetensors.torch as st
        import pinload, pinload.torch as pt
        rows = []
        for path in sys.argv[1:]:
            # zero_copy="off": read, as a cold file is, not copied from its mapping of the page cache
            got = pt.load_file(path, device="sim", zero_copy="off")
            want = st.load_file(path)
            assert list(got) == list(want), path
            for k in want:
                assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), (path, k)
            rows.append({"main": pinload.pool_stats("sim"),
                         "staging": pinload.pool_stats("sim", staging_bytes=pinload.DEFAULT_STAGING_BYTES)})
            del got
        print(json.dumps(rows))
    """, *map(str, files))
    import json
    rows = json.loads(out.strip().splitlines()[-1])
    for r in rows:
        # no pinned host copy of any model: the device's own pool was never used
        assert r["main"]["reserved"] == 0 and r["main"]["allocations"] == 0, r
        assert 0 < r["staging"]["peak_reserved"] <= pinload.DEFAULT_STAGING_BYTES, r
        assert r["staging"]["in_use"] == 0, r  # every staging block back once the load returned
    first, later = rows[0]["staging"], rows[-1]["staging"]
    biggest = rows[1]["staging"]
    # pinned once: the loads after the one that needed the most staging make no new reservation
    assert later["os_reservations"] == biggest["os_reservations"], rows
    assert later["free_list_hits"] > biggest["free_list_hits"] >= first["free_list_hits"], rows
    assert later["allocations"] > first["allocations"], rows


def test_fresh_device_loads_of_cached_files_copy_from_the_page_cache(files):
    # Files in the page cache are copied to the device from their mappings (Note [Copies from
    # mapped memory] in src/load/device_mapped.h): no staging at all, and no pinned copy.
    out = run_fresh("""
        import json, sys, torch, safetensors.torch as st
        import pinload, pinload.torch as pt
        rows = []
        for path in sys.argv[1:]:
            got = pt.load_file(path, device="sim")
            want = st.load_file(path)
            for k in want:
                assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), (path, k)
            rows.append({"main": pinload.pool_stats("sim"),
                         "staging": pinload.pool_stats("sim", staging_bytes=pinload.DEFAULT_STAGING_BYTES)})
            del got
        print(json.dumps(rows))
    """, *map(str, files))
    import json
    for r in json.loads(out.strip().splitlines()[-1]):
        assert r["main"]["reserved"] == 0 and r["staging"]["peak_reserved"] == 0, r


def test_fresh_device_prefetch_still_reads_ahead_into_the_pool(files):
    out = run_fresh("""
        import sys, torch, safetensors.torch as st
        import pinload, pinload.torch as pt
        path = sys.argv[1]
        p = pinload.prefetch(path, device="sim")
        p.wait()
        print(pinload.pool_stats("sim")["in_use"])  # the whole file, read ahead
        got = pt.load_file(path, device="sim", prefetch=p)
        want = st.load_file(path)
        assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
        print(p.adopted)
    """, str(files[1]))
    lines = out.split()
    assert int(lines[0]) >= os.path.getsize(files[1]) - 16384
    assert lines[1] == "True"
