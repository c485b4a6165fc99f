"""Every public name of the installed safetensors' Python API is in pinload, pinload.torch and
pinload.numpy, and behaves as the reference's on the same inputs; a misspelled load option raises
TypeError naming it; no error names the temporary file that load(bytes) goes through."""

import glob
import os
import struct
import types

import numpy as np
import pytest
import torch

import pinload
import pinload.numpy as pnp
import pinload.torch as pt

safetensors = pytest.importorskip("safetensors")
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402


def public_api(module):
    """The names a user of ``module`` can call: not private, not a module, not a name it imported
    from typing or collections."""
    out = set()
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if getattr(value, "__module__", "") in ("typing", "collections", "typing_extensions"):
            continue
        out.add(name)
    return out


@pytest.mark.parametrize("reference,ours", [(safetensors, pinload), (safetensors.torch, pt),
                                            (safetensors.numpy, pnp)], ids=["top", "torch", "numpy"])
def test_every_public_name(reference, ours):
    names = public_api(reference)
    assert {"safe_open", "deserialize"} <= names  # the comparison sees the API
    missing = sorted(n for n in names if not hasattr(ours, n))
    assert not missing, f"{ours.__name__} lacks {missing}"
    for name in ("torch", "numpy"):
        if hasattr(reference, name) and isinstance(getattr(reference, name), types.ModuleType):
            assert isinstance(getattr(ours, name), types.ModuleType)


def test_reference_classes_are_the_references():
    for name in ("TensorSpec", "SafetensorError"):
        if hasattr(safetensors, name):
            assert getattr(pinload, name) is getattr(safetensors, name)
            assert getattr(pt, name) is getattr(safetensors, name)
            assert getattr(pnp, name) is getattr(safetensors, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        pinload.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_name"):
        pnp.no_such_name  # noqa: B018
    with pytest.raises(pinload.SafetensorError):  # a pinload error is the reference's SafetensorError too
        pt.load(b"\x00")


_ARRAYS = {  # kept alive: a TensorSpec holds a raw pointer to its bytes
    "b": np.arange(1, 5, dtype=np.float32).reshape(2, 2),
    "a": np.array([1, 2, -1], dtype=np.int8),
    "empty": np.zeros((0, 4), dtype=np.float16),
    "h": np.ones(1, dtype=np.float16),
}


def specs():
    """serialize's input: TensorSpecs, as safetensors' own save builds them."""
    return {name: safetensors.TensorSpec(dtype=str(a.dtype), shape=list(a.shape), data_ptr=a.ctypes.data,
                                         data_len=a.nbytes)
            for name, a in _ARRAYS.items()}


@pytest.mark.parametrize("module", [pinload, pt, pnp], ids=["top", "torch", "numpy"])
def test_serialize_and_deserialize_as_the_reference(module, tmp_path):
    meta = {"format": "pt"}  # one key: the reference writes several in hash order
    data = module.serialize(specs(), metadata=meta)
    assert data == safetensors.serialize(specs(), metadata=meta)
    assert module.serialize(specs()) == safetensors.serialize(specs())
    module.serialize_file(specs(), str(tmp_path / "ours.safetensors"), metadata=meta)
    safetensors.serialize_file(specs(), str(tmp_path / "ref.safetensors"), metadata=meta)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    got = module.deserialize(data)
    want = safetensors.deserialize(data)  # in hash order: the same pairs, in any order
    assert sorted(got, key=lambda kv: kv[0]) == sorted(want, key=lambda kv: kv[0])
    assert {type(d["data"]) for _, d in got} == {type(d["data"]) for _, d in want} == {bytearray}
    assert [name for name, _ in got] == safetensors.safe_open(str(tmp_path / "ref.safetensors"), "np").offset_keys()
    assert module.deserialize(bytearray(data)) == got
    assert module.deserialize(safetensors.torch.save({})) == safetensors.deserialize(safetensors.torch.save({}))


def shm_files():
    return set(glob.glob("/dev/shm/pinload-*"))


BAD = {
    "header too large": struct.pack("<Q", 1 << 40) + b"{}",
    "not json": struct.pack("<Q", 8) + b"notjson!",
    "beyond the end": struct.pack("<Q", 64) + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'.ljust(64),
}


@pytest.mark.parametrize("what", sorted(BAD))
@pytest.mark.parametrize("load", [pt.load, pnp.load, pinload.deserialize],
                         ids=["torch.load", "numpy.load", "deserialize"])
def test_errors_of_bytes_name_no_temporary_file(what, load):
    before = shm_files()
    with pytest.raises(pinload.Error) as info:
        load(BAD[what])
    text = str(info.value)
    assert "/dev/shm" not in text and "pinload-" not in text and "/tmp" not in text, text
    assert info.value.file in (None, "<bytes>")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value, safetensors.SafetensorError)
    with pytest.raises(Exception):  # the reference refuses the same bytes
        safetensors.deserialize(BAD[what])
    assert shm_files() == before  # the temporary file is gone


@pytest.fixture
def file(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                                 "b": np.arange(5, dtype=np.int16)}, str(path), metadata={"m": "1"})
    return str(path)


def test_numpy_safe_open_as_the_reference(file):
    with pnp.safe_open(file, framework="np") as ours, safetensors.numpy.safe_open(file, framework="np") as ref:
        assert ours.keys() == ref.keys()
        assert ours.offset_keys() == ref.offset_keys()
        assert ours.metadata() == ref.metadata()
        for name in ref.keys():
            got, want = ours.get_tensor(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and np.array_equal(got, want)
            assert ours.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
        for index in (slice(None), 1, (slice(0, 1), slice(1, 3)), (Ellipsis, 2)):
            assert np.array_equal(ours.get_slice("w")[index], ref.get_slice("w")[index])
        with pytest.raises(pinload.NotFoundError, match="File does not contain tensor nope"):
            ours.get_tensor("nope")
        tensors = ours.get_tensors()
        assert list(tensors) == ours.offset_keys()
    with pytest.raises(pinload.Error, match="File is closed"):
        ours.keys()
    with pytest.raises(pinload.NotFoundError, match="No such file or directory"):
        pnp.safe_open(file + ".missing", framework="np")
    with pytest.raises(pinload.InvalidFileError, match="host memory"):
        pnp.safe_open(file, framework="np", device="cuda:0")
    with pnp.safe_open(file, framework="pt") as f:  # the reference's safe_open takes "pt" too
        assert isinstance(f.get_tensor("w"), torch.Tensor)
        assert torch.equal(f.get_tensor("w"), torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))


def test_storage_helpers_as_the_reference():
    t = torch.arange(6)
    assert pt.storage_ptr(t) == safetensors.torch.storage_ptr(t)
    assert pt.storage_size(t[2:]) == safetensors.torch.storage_size(t[2:])


CALLS = {
    "LoadOptions": lambda f, **kw: pinload.LoadOptions(**kw),
    "torch.load_file": lambda f, **kw: pt.load_file(f, **kw),
    "safe_open": lambda f, **kw: pinload.safe_open(f, **kw),
    "numpy.load_file": lambda f, **kw: pnp.load_file(f, **kw),
    "numpy.safe_open": lambda f, **kw: pnp.safe_open(f, framework="np", **kw),
    "load_files": lambda f, **kw: pinload.load_files([f], **kw),
    "prefetch": lambda f, **kw: pinload.prefetch([f], **kw),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_unknown_keyword_is_a_type_error_naming_it(call, file):
    with pytest.raises(TypeError) as info:
        CALLS[call](file, thread=4)
    text = str(info.value)
    assert "'thread'" in text and "did you mean 'threads'" in text, text
    assert "incompatible" not in text
    with pytest.raises(TypeError, match="'colour'"):
        CALLS[call](file, colour="red")


def test_the_message_lists_every_option():
    with pytest.raises(TypeError) as info:
        pinload.LoadOptions(nope=1)
    listed = str(info.value).split("the load options are ")[1].split(", ")
    assert sorted(listed) == sorted(pinload.LoadKwargs.__annotations__)
    with pytest.raises(TypeError, match="keyword arguments only"):
        pinload.LoadOptions(4)
    assert pinload.LoadOptions(threads=3).threads == 3  # the real constructor still comes first
    with pytest.raises(TypeError, match="threads must be an int"):
        pinload.LoadOptions(threads="4")


def test_wrong_keyword_of_the_reference_functions():
    with pytest.raises(TypeError, match="metdata"):
        pinload.serialize(specs(), metdata={})
    with pytest.raises(TypeError, match="tensors_dict"):
        pt.serialize_file(tensors_dict={}, filename=os.devnull)
