"""pinload.safe_open against safetensors.safe_open: keys, metadata, tensors, slices, shapes, dtypes."""

import threading

import pytest
import torch
import safetensors.torch as st
from safetensors import safe_open as reference_open

import pinload
from pl_helpers import DEVICES, assert_same, every_dtype_tensors, in_use, write_raw


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity")
    gen = torch.Generator().manual_seed(7)
    mixed = every_dtype_tensors(seed=5)
    mixed["attn.qkv"] = torch.randn(6, 10, 4, generator=gen)
    mixed["vec"] = torch.arange(17, dtype=torch.int64)
    with_md = folder / "with_metadata.safetensors"
    st.save_file(mixed, str(with_md), metadata={"format": "pt", "note": "ünïcode ✓"})
    no_md = folder / "no_metadata.safetensors"
    st.save_file({"b": torch.ones(2), "a": torch.zeros(3, dtype=torch.int32), "c": torch.ones(())}, str(no_md))
    empty_md = folder / "empty_metadata.safetensors"
    st.save_file({"x": torch.ones(1)}, str(empty_md), metadata={})
    # Offsets deliberately out of name order, written by hand.
    by_hand = write_raw(folder / "by_hand.safetensors",
                        [("zeta", "F32", [2], b"\0" * 8), ("alpha", "I16", [3], b"\1\0\2\0\3\0"),
                         ("mid", "U8", [0], b""), ("beta", "BF16", [1, 2], b"\x80\x3f\x00\x40")],
                        metadata={"k": "v"})
    return [with_md, no_md, empty_md, by_hand]


SLICES = [
    (Ellipsis,), (slice(None),), (0,), (-1,), (slice(1, 3),), (slice(0, 5, 2),), (slice(1, None), slice(None, 2)),
    (1, slice(2, 8, 3)), (slice(None), 0, slice(1, 3)), (Ellipsis, 1),
]


@pytest.mark.parametrize("index", range(4))
def test_header_parity(files, index):
    path = files[index]
    with reference_open(str(path), framework="pt") as ref, pinload.safe_open(path, framework="pt") as got:
        assert got.keys() == ref.keys()
        assert got.offset_keys() == ref.offset_keys()
        assert got.metadata() == ref.metadata()
        for name in ref.keys():
            rs, gs = ref.get_slice(name), got.get_slice(name)
            assert gs.get_shape() == rs.get_shape() == got.get_shape(name)
            assert gs.get_dtype() == rs.get_dtype() == got.get_dtype(name)
            assert isinstance(got.get_shape(name), list)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(4))
def test_tensor_and_slice_parity(files, index, device):
    path = files[index]
    with reference_open(str(path), framework="pt") as ref, pinload.safe_open(path, "pt", device=device) as got:
        for name in ref.keys():
            want = ref.get_tensor(name)
            assert_same(got.get_tensor(name), want, name)
            rs, gs = ref.get_slice(name), got.get_slice(name)
            for idx in SLICES:
                idx = idx if len(idx) > 1 else idx[0]
                try:
                    expected = rs[idx]
                except Exception:
                    continue  # an index safetensors does not take for this rank
                result = gs[idx]
                assert result.is_contiguous()
                assert_same(result, expected, f"{name}[{idx}]")
        all_tensors = got.get_tensors()
        assert list(all_tensors) == got.offset_keys()
        for name, t in all_tensors.items():
            assert_same(t, ref.get_tensor(name), name)


def test_lazy_load_only_when_data_is_asked(files):
    path = files[0]
    allocations = pinload.pool_stats()["allocations"]
    # Read into the pool: a file in the page cache is otherwise mapped (Note [Zero-copy loads]),
    # depending on what earlier tests left in the pool.
    f = pinload.safe_open(path, zero_copy="off")
    f.keys(), f.metadata(), f.get_slice("vec").get_shape(), f.get_dtype("vec")
    assert pinload.pool_stats()["allocations"] == allocations  # header only
    f.get_tensor("vec")
    f.get_slice("attn.qkv")[0]
    f.get_tensors()
    assert pinload.pool_stats()["allocations"] == allocations + 1  # one load serves every later call
    f.close()


def test_concurrent_slices_share_one_load(files):
    path = files[0]
    allocations = pinload.pool_stats()["allocations"]
    with pinload.safe_open(path, zero_copy="off") as f, reference_open(str(path), "pt") as ref:  # into the pool
        names = f.keys()
        results, errors = {}, []

        def worker(chunk):
            try:
                for n in chunk:
                    results[n] = f.get_slice(n)[...]
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(names[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for n in names:
            assert_same(results[n], ref.get_tensor(n), n)
    assert pinload.pool_stats()["allocations"] == allocations + 1


def test_closed_handle_and_tensors_that_outlive_it(files):
    path = files[0]
    base = in_use()
    f = pinload.safe_open(path, zero_copy="off")  # into the pool, whose blocks the tensors hold
    vec = f.get_tensor("vec")
    view = f.get_slice("attn.qkv")[...]
    s = f.get_slice("vec")
    f.close()
    for call in (f.keys, f.offset_keys, f.metadata, lambda: f.get_tensor("vec"), lambda: f.get_slice("vec"),
                 lambda: s[0], lambda: f.get_shape("vec"), f.__enter__):
        with pytest.raises(pinload.Error, match="closed") as info:
            call()
        assert info.value.file == str(path)
    del f
    assert in_use() > base  # the tensors hold their block
    assert vec.tolist() == list(range(17))
    assert view.shape == (6, 10, 4)
    del vec
    assert in_use() > base
    del view
    assert in_use() == base


def test_missing_tensor_and_bad_framework(files):
    path = files[1]
    with pinload.safe_open(path) as f:
        for call in (lambda: f.get_tensor("nope"), lambda: f.get_slice("nope"), lambda: f.get_shape("nope")):
            with pytest.raises(pinload.NotFoundError) as info:
                call()
            assert info.value.tensor == "nope" and info.value.file == str(path)
    with pytest.raises(pinload.InvalidFileError, match="framework"):
        pinload.safe_open(path, framework="flax")


def test_backend_argument_is_accepted(files):
    with pinload.safe_open(files[1], framework="pt", device="cpu", backend="mmap") as f:
        assert f.get_tensor("b").tolist() == [1.0, 1.0]
