"""DLPack export (Note [DLPack export] in src/python/dlpack_export.h): typed, shaped, zero-copy
arrays for torch and numpy, checked against the reference safetensors reader."""

import numpy as np
import pytest
import torch
import safetensors.numpy as snp
import safetensors.torch as st

import pinload
import pinload.torch as pt
from pl_helpers import write_raw


def _state_dict(path, device="cpu"):
    return pinload._core.load_async([str(path).encode()], device).result()


def test_numpy_gets_typed_shaped_arrays_equal_to_the_reference(tmp_path):
    rng = np.random.default_rng(5)
    arrays = {
        "f32": rng.standard_normal((3, 4, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2)),
        "i8": rng.integers(-128, 127, (9, 1), dtype=np.int8),
        "u16": rng.integers(0, 1 << 16, (4, 4), dtype=np.uint16),
        "i64": rng.integers(-(1 << 40), 1 << 40, (3,), dtype=np.int64),
        "u64": rng.integers(0, 1 << 62, (2, 3), dtype=np.uint64),
        "b": rng.integers(0, 2, (6,)).astype(np.bool_),
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "scalar": np.array(3.5, dtype=np.float32),
    }
    path = tmp_path / "np.safetensors"
    snp.save_file(arrays, str(path))
    expected = snp.load_file(str(path))
    sd = _state_dict(path)
    for name, dtype, shape, export in sd.export_all():
        got = np.from_dlpack(export)
        assert got.dtype == expected[name].dtype, name
        assert list(got.shape) == shape == list(expected[name].shape), name
        assert np.array_equal(got, expected[name]), name


def test_torch_gets_typed_tensors_without_a_copy(small_file):
    path, tensors = small_file
    sd = _state_dict(path)
    for name, dtype, shape, export in sd.export_all():
        a = torch.from_dlpack(export)
        b = torch.from_dlpack(export)  # an export can be consumed more than once
        assert a.dtype == tensors[name].dtype and list(a.shape) == shape, name
        assert a.data_ptr() == b.data_ptr(), name  # both alias the pool block
        assert torch.equal(a, tensors[name]), name
    loaded = pt.load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_float8_and_bfloat16_go_out_typed(tmp_path):
    tensors = {"e4m3": torch.randn(4, 2).to(torch.float8_e4m3fn), "e5m2": torch.randn(3).to(torch.float8_e5m2),
               "bf16": torch.randn(2, 3, dtype=torch.bfloat16)}
    path = tmp_path / "f8.safetensors"
    st.save_file(tensors, str(path))
    for name, dtype, shape, export in _state_dict(path).export_all():
        t = torch.from_dlpack(export)
        assert t.dtype == tensors[name].dtype and list(t.shape) == shape, name
        assert torch.equal(t.view(torch.uint8), tensors[name].view(torch.uint8)), name


def test_sub_byte_types_go_out_as_bytes(tmp_path):
    path = write_raw(tmp_path / "f4.safetensors", [("packed", "F4", [4, 2], b"\x12\x34\x56\x78")])
    (name, dtype, shape, export), = _state_dict(path).export_all()
    assert (dtype, shape) == ("F4", [4, 2])
    got = np.from_dlpack(export)
    assert got.dtype == np.uint8 and got.tobytes() == b"\x12\x34\x56\x78"


def test_protocol_details(small_file):
    path, _ = small_file
    _, _, _, export = _state_dict(path).export("w")
    assert export.__dlpack_device__() == (1, 0)  # kDLCPU
    assert export.nbytes == 48
    with pytest.raises(BufferError):
        export.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        export.__dlpack__(copy=True)
    legacy = export.__dlpack__()
    versioned = export.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "dltensor_versioned" in repr(versioned)
    del legacy, versioned  # unconsumed capsules free what they hold


def test_sim_device_exports_are_host_memory(small_file):
    path, tensors = small_file
    sd = _state_dict(path, "sim")
    assert sd.device == "sim" and sd.torch_device == "cpu"
    for name, _, _, export in sd.export_all():
        assert export.__dlpack_device__() == (1, 0)
        assert torch.equal(torch.from_dlpack(export), tensors[name])
