"""Lifetimes: tensors hold their pool block; loads and frees return the pool to its baseline.

Host loads here read into the pool (zero_copy="off"): zero-copy loads hold no pool block
(Note [Zero-copy loads]; their lifetimes: tests/unit/zero_copy_test.cc)."""

import gc

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch as pt
from pl_helpers import DEVICES, assert_same_dict, in_use


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    gen = torch.Generator().manual_seed(11)
    tensors = {f"layer{i}.weight": torch.randn(64, 33, generator=gen) for i in range(4)}
    tensors["ids"] = torch.arange(7)
    path = tmp_path_factory.mktemp("lifetime") / "model.safetensors"
    st.save_file(tensors, str(path))
    return path, tensors


def test_thousand_loads_and_frees_return_to_baseline(model_file):
    path, tensors = model_file
    pt.load_file(path, zero_copy="off")  # the first load reserves the pool's memory
    base = in_use()
    stats0 = pinload.pool_stats()
    for i in range(1000):
        got = pt.load_file(path, threads=2, zero_copy="off")
        if i % 97 == 0:
            assert_same_dict(got, tensors)
            assert in_use() > base
        del got
    stats1 = pinload.pool_stats()
    assert in_use() == base
    assert stats1["live_blocks"] == stats0["live_blocks"]
    # Re-loads reuse pool blocks: no new OS reservation, every allocation from a free list.
    assert stats1["os_reservations"] == stats0["os_reservations"]
    assert stats1["allocations"] - stats0["allocations"] == 1000
    assert stats1["free_list_hits"] - stats0["free_list_hits"] == 1000


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_device_loads_return_to_baseline(model_file, device):
    path, tensors = model_file
    pt.load_file(path, device=device)
    base_host = in_use(device)
    for _ in range(100):
        got = pt.load_file(path, device=device)
        del got
    assert in_use(device) == base_host
    got = pt.load_file(path, device=device)
    # A device tensor holds its device buffer, not the pinned host copy: the pool is back at its
    # baseline while the tensors are alive.
    assert in_use(device) == base_host
    assert_same_dict(got, tensors)


def test_tensors_outlive_state_dict_and_views_hold_the_block(model_file):
    path, tensors = model_file
    base = in_use()
    got = pt.load_file(path, zero_copy="off")
    row = got["layer2.weight"][5]  # a view into the loaded tensor
    ids = got["ids"]
    del got
    assert in_use() > base
    assert torch.equal(row, tensors["layer2.weight"][5])
    del row
    assert in_use() > base  # ids still holds the file's block
    assert ids.tolist() == list(range(7))
    del ids
    assert in_use() == base


def test_iter_tensors_releases_as_the_consumer_drops(model_file):
    path, tensors = model_file
    base = in_use()
    gen = pinload.iter_tensors(path)
    name, first = next(gen)
    assert torch.equal(first, tensors[name])
    del first
    rest = dict(gen)
    assert len(rest) == len(tensors) - 1
    del rest, gen
    assert in_use() == base


def test_dropped_handle_in_flight(model_file):
    path, _ = model_file
    base = in_use()
    for _ in range(50):
        h = pinload._core.load_async([str(path).encode()], "cpu", zero_copy="off")
        del h  # cancels and joins; must not crash or leak a block
    gc.collect()
    assert in_use() == base


def test_unconsumed_capsules_free_their_block(model_file):
    path, _ = model_file
    base = in_use()
    h = pinload._core.load_async([str(path).encode()], "cpu", zero_copy="off")
    sd = h.result()
    capsules = sd.export_all()
    del sd, h
    assert in_use() > base
    del capsules  # never handed to torch: the capsules' destructors free the tensors
    assert in_use() == base


def test_pool_is_shared_per_device(model_file):
    path, _ = model_file
    assert pinload.pool_stats("cpu")["backend"] == pinload.pool_stats(None)["backend"]
    before = pinload.pool_stats()["allocations"]
    pt.load_file(path, zero_copy="off")
    pinload.safe_open(path).get_tensors()
    pinload.load_files([path])
    assert pinload.pool_stats()["allocations"] == before + 3
    pinload.trim_pool()  # idle memory back to the OS; in-use blocks stay
    assert pinload.pool_stats()["in_use"] == in_use()


def test_iter_tensors_returns_each_shard_once_dropped(tmp_path):
    """A 4-shard Llama-shaped checkpoint streamed with files_in_flight=1, each tensor dropped at
    once: a shard's block goes back to the pool once its tensors are gone, so while the last
    shard's tensors arrive only that shard's block is in use (not the whole checkpoint's)."""
    gen = torch.Generator().manual_seed(3)
    shards, weight_map = [], {}
    for s in range(4):
        tensors = {f"model.layers.{s}.self_attn.{p}_proj.weight": torch.randn(256, 256, generator=gen)
                   for p in ("q", "k", "v", "o")}
        name = f"model-{s + 1:05d}-of-00004.safetensors"
        st.save_file(tensors, str(tmp_path / name))
        weight_map.update({t: name for t in tensors})
        shards.append(tensors)
    index = tmp_path / "model.safetensors.index.json"
    import json

    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = {k: v for shard in shards for k, v in shard.items()}
    shard_bytes = sum(t.numel() * 4 for t in shards[0].values())
    gc.collect()
    base = in_use()
    by_shard = {}
    seen = set()
    for name, tensor in pinload.iter_tensors(index, files_in_flight=1, threads=2, zero_copy="off"):
        assert torch.equal(tensor, want[name]), name
        seen.add(name)
        shard = int(name.split(".")[2])
        by_shard.setdefault(shard, []).append(in_use() - base)
        del tensor
    assert seen == set(want)
    # Blocks are reserved when the load starts (the peak is the whole checkpoint) ...
    order = list(by_shard)  # shards in the order their tensors arrived
    assert max(by_shard[order[0]]) >= 3.5 * shard_bytes
    # ... and each comes back once its shard has been consumed: at the last shard, one block.
    assert max(by_shard[order[-1]]) <= 1.5 * shard_bytes, by_shard
    gc.collect()
    assert in_use() == base
