"""pinload.prefetch: returns at once, reads in the background, and a later load adopts it (nothing
read twice, blocks handed over); cancel() stops it and what was read stays adoptable."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch as pt


def _write(tmp_path, name="m.safetensors", n=8, numel=200_000):
    g = torch.Generator().manual_seed(7)
    tensors = {f"layer.{i}.weight": torch.randn(numel + i, generator=g) for i in range(n)}
    path = tmp_path / name
    st.save_file(tensors, str(path))
    return path, tensors


def _wait_done(p, timeout=30.0):
    assert p.wait(timeout), "the prefetch did not finish"


def _expect_equal(loaded, expected):
    assert set(loaded) == set(expected)
    for name, t in expected.items():
        assert torch.equal(loaded[name], t), name


def test_prefetch_then_adopting_load_reads_nothing_more(tmp_path):
    path, tensors = _write(tmp_path)
    p = pinload.prefetch(path, block_size="64K")
    assert isinstance(p, pinload._core.Prefetch)
    _wait_done(p)
    assert p.done()
    prog = p.progress()
    assert prog["bytes_total"] > 0 and prog["bytes_done"] == prog["bytes_total"]
    before = pinload.pool_stats()["allocations"]
    sd = pt.load_file(path, prefetch=p)
    assert p.adopted
    # Adopting hands the prefetch's block over: no new pool allocation.
    assert pinload.pool_stats()["allocations"] == before
    _expect_equal(sd, tensors)


def test_cancel_stops_and_what_was_read_is_adopted(tmp_path):
    path, tensors = _write(tmp_path, n=16)
    p = pinload.prefetch(str(path), block_size="4K", threads=1)
    p.cancel()
    assert p.done()
    done = p.progress()["bytes_done"]
    time.sleep(0.02)
    assert p.progress()["bytes_done"] == done, "nothing may be read after cancel()"
    _expect_equal(pt.load_files([path], prefetch=p), tensors)
    assert p.adopted


def test_load_of_other_paths_or_device_ignores_the_prefetch(tmp_path):
    a, ta = _write(tmp_path, "a.safetensors")
    b, _ = _write(tmp_path, "b.safetensors", n=2)
    p = pinload.prefetch(b)
    _expect_equal(pt.load_file(a, prefetch=p), ta)
    assert not p.adopted
    del p
    gc.collect()


@pytest.mark.skipif("sim" not in __import__("pl_helpers").DEVICES, reason="no sim device")
def test_streaming_prefetch_under_a_budget_is_adopted_by_a_device_load(tmp_path):
    path, tensors = _write(tmp_path, n=6, numel=100_000)  # about 2.4 MB
    budget = 1 << 20
    p = pinload.prefetch(path, device="sim", block_size="64K", staging_bytes=budget)
    sd = pt.load_file(path, device="sim", block_size="64K", staging_bytes=budget, prefetch=p)
    assert p.adopted
    _expect_equal(sd, tensors)


def test_bad_arguments(tmp_path):
    path, _ = _write(tmp_path, n=1)
    with pytest.raises(ValueError):
        pinload.prefetch([])
    with pytest.raises(TypeError):
        pt.load_file(path, prefetch="not a prefetch")
    missing = pinload.prefetch(tmp_path / "missing.safetensors")
    _wait_done(missing)
    with pytest.raises(pinload.NotFoundError):
        pt.load_file(tmp_path / "missing.safetensors", prefetch=missing)


def test_dropping_a_running_prefetch_frees_its_memory(tmp_path):
    path, _ = _write(tmp_path, n=16)
    gc.collect()
    before = pinload.pool_stats()["in_use"]
    p = pinload.prefetch(path, block_size="4K", threads=1)
    del p
    gc.collect()
    assert pinload.pool_stats()["in_use"] == before
