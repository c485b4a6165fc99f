"""pinload.torch.load_files_batch: many independent files, one state dict each (pinload/batch.h).

Every state dict is compared byte for byte with the reference reader (safetensors.torch.load_file)
and with pinload's own single-file load; bad files among good ones fail as documented
(docs/python.md): alone, naming the file, and nothing partial.
"""

from __future__ import annotations

import os

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch as pt

from pl_helpers import DEVICES


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(t)), name


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """100 LoRA-like files of one base model: the same tensor names in every file."""
    d = tmp_path_factory.mktemp("loras")
    g = torch.Generator().manual_seed(3)
    paths = []
    for i in range(100):
        rank = 1 + i % 8
        tensors = {}
        for k in range(6):
            tensors[f"unet.block{k}.attn.to_q.lora_A.weight"] = torch.randn(rank, 64 + k, generator=g)
            tensors[f"unet.block{k}.attn.to_q.lora_B.weight"] = torch.randn(64 + k, rank, generator=g).half()
            tensors[f"unet.block{k}.attn.to_q.alpha"] = torch.tensor(float(rank))
        p = d / f"lora{i:03d}.safetensors"
        st.save_file(tensors, str(p), metadata={"index": str(i)})
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("device", DEVICES)
def test_equal_to_reference_and_to_single_loads(library, device):
    got = pt.load_files_batch(library, device=device, threads=4, block_size="64K")
    assert list(got) == library
    for p in library:
        _same(got[p], st.load_file(p))
        _same(got[p], pt.load_file(p, device=device))


def test_one_bad_file_among_a_hundred(library, tmp_path):
    paths = list(library)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    paths[41] = str(bad)
    # Default: the bad file's own error, naming it; nothing returned.
    with pytest.raises(pinload.InvalidFileError) as info:
        pt.load_files_batch(paths)
    assert info.value.file == str(bad)
    assert list(info.value.errors) == [str(bad)]
    # return_errors: the bad file's value is its error; every other one is whole and correct.
    got = pt.load_files_batch(paths, return_errors=True)
    assert isinstance(got[str(bad)], pinload.InvalidFileError)
    for i, p in enumerate(paths):
        if i != 41:
            _same(got[p], st.load_file(p))


def test_missing_and_duplicate_paths(library, tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    got = pt.load_files_batch([library[0], missing], return_errors=True)
    assert isinstance(got[missing], pinload.NotFoundError) and got[missing].file == missing
    _same(got[library[0]], st.load_file(library[0]))
    with pytest.raises(ValueError, match="given twice"):
        pt.load_files_batch([library[0], library[0]])
    with pytest.raises(TypeError):
        pt.load_files_batch(library[:2], dtype="bf16")


def test_tensors_outlive_the_batch(library):
    got = pt.load_files_batch(library[:3])
    keep = got[library[1]]
    del got
    import gc

    gc.collect()
    _same(keep, st.load_file(library[1]))


def test_backend_and_os_paths(library):
    got = pt.load_files_batch([os.fsencode(library[0])], backend="pread")
    _same(got[library[0]], st.load_file(library[0]))


def test_a_batch_larger_than_its_budget_stays_within_it(tmp_path):
    """Streaming within a budget, the batch path: with pool_bytes smaller than the library, the batch holds at
    most the budget; each path that does not fit fails alone with OutOfMemoryError naming it (the
    consumer drops what it has and asks again), and the others are whole and exact."""
    g = torch.Generator().manual_seed(5)
    paths = []
    for i in range(24):
        p = tmp_path / f"l{i:02d}.safetensors"
        st.save_file({"a": torch.randn(256, 1024, generator=g)}, str(p))  # 1 MiB each
        paths.append(str(p))
    budget = 8 << 20
    out = pt.load_files_batch(paths, pool_bytes=budget, return_errors=True)
    ok = [p for p, v in out.items() if not isinstance(v, BaseException)]
    assert 0 < len(ok) < len(paths)
    for p, v in out.items():
        if isinstance(v, BaseException):
            assert isinstance(v, pinload.OutOfMemoryError) and v.file == p, (p, v)
        else:
            _same(v, st.load_file(p))
    assert pinload.pool_stats("cpu", pool_bytes=budget)["peak_reserved"] <= budget
    rest = [p for p in paths if p not in ok]
    del out
    again = pt.load_files_batch(rest[:2], pool_bytes=budget)  # what was held is back in the pool
    for p in rest[:2]:
        _same(again[p], st.load_file(p))


def test_a_failing_batch_holds_no_tensors(library, tmp_path):
    """The raised error's traceback holds load_files_batch's frame, which held every good member's
    state dict: an error kept (or caught in a cycle) kept all their tensors alive."""
    import gc

    from pl_helpers import in_use

    from pl_helpers import write_raw

    # A valid file whose shape torch cannot hold: its error is raised inside load_files_batch while
    # the good members' state dicts are built, so its traceback holds the frame that holds them.
    bad = write_raw(tmp_path / "bad.safetensors", [("odd", "U8", [1 << 63, 0], b"")])
    gc.collect()
    base = in_use()
    gc.disable()
    try:
        for _ in range(3):
            try:
                pt.load_files_batch(library[:20] + [str(bad)], zero_copy="off")
            except pinload.InvalidFileError as e:
                assert str(bad) in str(e)
                # Whatever else holds the error (a caller that keeps it, a cycle), the frame in its
                # traceback holds none of the good members' state dicts.
                tb, frames = e.__traceback__, []
                while tb is not None:
                    frames += [tb.tb_frame] if tb.tb_frame.f_code.co_name == "load_files_batch" else []
                    tb = tb.tb_next
                assert frames, "load_files_batch's frame is not in the traceback"
                held = [v for f in frames for v in f.f_locals.values() if isinstance(v, (dict, list))]
                assert not any(isinstance(t, torch.Tensor) for v in held
                               for d in (v.values() if isinstance(v, dict) else v) if isinstance(d, dict)
                               for t in d.values()), "the traceback's frame holds state dicts"
                del e, tb, frames, held
            else:
                pytest.fail("the bad file did not raise")
            assert in_use() == base  # every good member's block back in the pool, without gc
    finally:
        gc.enable()
