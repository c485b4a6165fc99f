"""pinload.torch.safe_open_handle: safe_open over a Python file object (safetensors'
_safe_open_handle), Note [Handles] in python/pinload/_file_handle.py."""

import io
import os

import numpy as np
import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors import _safe_open_handle as reference_handle  # noqa: E402
from safetensors.torch import load as reference_load, save, save_file  # noqa: E402

import pinload  # noqa: E402
from pinload.torch import safe_open_handle  # noqa: E402


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8)}


def reference_of(f):
    with reference_handle(f, framework="pt") as g:
        return {k: g.get_tensor(k) for k in g.keys()}


def read_all(handle):
    return {k: handle.get_tensor(k) for k in handle.keys()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_a_real_file_is_read_through_its_descriptor_and_held(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(tensors(1), str(path))
    with open(path, "rb") as f:
        want = reference_of(f)
        with safe_open_handle(f, framework="pt") as g:
            assert g._path.startswith("/proc/self/fd/")
            # The path replaced (and the object closed) before the first get_tensor: the handle
            # still reads the file it was given, as the reference does.
            save_file(tensors(2), str(tmp_path / "other.safetensors"))
            os.replace(tmp_path / "other.safetensors", path)
            f.close()
            assert_same(read_all(g), want)


def test_a_text_mode_file_and_numpy(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(tensors(3), str(path))
    with open(path, "r") as f:  # text mode, as the reference's own test opens it
        with safe_open_handle(f, framework="np") as g:
            got = {k: g.get_tensor(k) for k in g.keys()}
    want = tensors(3)
    for k in want:
        assert isinstance(got[k], np.ndarray) and np.array_equal(got[k], want[k].numpy()), k


def test_an_object_without_a_descriptor_is_read_through_read(tmp_path):
    data = save(tensors(4))
    buffer = io.BytesIO(data)
    buffer.seek(5)  # read from the start whatever the position
    with safe_open_handle(buffer) as g:
        assert_same(read_all(g), reference_load(data))  # the reference's handle needs a .name


def test_objects_that_cannot_be_read_are_typed_errors(tmp_path):
    with pytest.raises(pinload.InvalidFileError, match="neither fileno"):
        safe_open_handle(object())
    with pytest.raises(pinload.InvalidFileError, match="text mode"):
        safe_open_handle(io.StringIO("not bytes"))
    closed = io.BytesIO(save(tensors(5)))
    closed.close()
    with pytest.raises(safetensors.SafetensorError, match="cannot read"):
        safe_open_handle(closed)


def test_a_handle_on_a_bad_file_names_the_problem(tmp_path):
    with pytest.raises(pinload.InvalidFileError):
        safe_open_handle(io.BytesIO(b"\x08\x00\x00\x00\x00\x00\x00\x00{bogus!}"))
