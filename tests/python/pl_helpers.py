"""Helpers shared by the tests of the pinload Python package (tests/python)."""

from __future__ import annotations

import gc
import json
import os
import struct
from pathlib import Path

import torch
import safetensors.torch as st

import pinload  # noqa: E402
import pinload.torch as pt  # noqa: E402


def _device_works(spec: str) -> bool:
    try:
        pinload.pool_stats(spec)
        return True
    except pinload.Error:
        return False


#: pinload devices the loads are checked on: the host, the CPU stand-in device, and CUDA when
#: both pinload and torch can use it.
DEVICES = ["cpu"] + (["sim"] if _device_works("sim") else [])
if torch.cuda.is_available() and pinload.cuda_available()[0]:
    DEVICES.append("cuda")


def torch_device_of(device: str) -> "torch.device":
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def raw_bytes(t: "torch.Tensor") -> bytes:
    """The bytes of a tensor (any dtype, any device)."""
    if t.numel() == 0:
        return b""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))  # standard strides
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same(a: "torch.Tensor", b: "torch.Tensor", name: str = "") -> None:
    """Same dtype, shape and bytes (NaN-safe: float8 and random bit patterns hold NaNs)."""
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert raw_bytes(a) == raw_bytes(b), f"{name}: bytes differ"


def assert_same_dict(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert_same(got[k], want[k], k)


# Every dtype torch and safetensors' writer share (the fnuz and e8m0 float8 types where present).
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))


def random_tensor(dtype: "torch.dtype", shape, gen: "torch.Generator") -> "torch.Tensor":
    """Random bit patterns of ``dtype`` (bool: 0/1 bytes)."""
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen, dtype=torch.uint8).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def every_dtype_tensors(seed: int = 0) -> dict:
    """A tensor per dtype and shape kind: 3-D, odd 1-D, scalar, zero-size."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for dtype in DTYPES:
        n = str(dtype).replace("torch.", "")
        out[f"{n}.matrix"] = random_tensor(dtype, (3, 5, 7), gen)
        out[f"{n}.odd"] = random_tensor(dtype, (13,), gen)
        out[f"{n}.scalar"] = random_tensor(dtype, (), gen)
        out[f"{n}.empty"] = random_tensor(dtype, (0, 4), gen)
    return out


def write_raw(path: Path, tensors, metadata=None, pad_to: int = 8) -> Path:
    """Writes a safetensors file by hand: tensors = [(name, dtype, shape, data bytes)], in order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return Path(path)


def write_sharded(folder: Path, tensors: dict, shards: int = 3, prefix: str = "model") -> Path:
    """Saves ``tensors`` in ``shards`` files plus a hand-written index; returns the index path."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    total = 0
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        fname = f"{prefix}-{i + 1:05d}-of-{shards:05d}.safetensors"
        st.save_file(part, str(folder / fname), metadata={"format": "pt", "shard": str(i)})
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = folder / f"{prefix}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


def mapped_ranges(path) -> list:
    """The address ranges of this process's mappings of `path` (/proc/self/maps): where a tensor
    handed out zero-copy lives."""
    real = os.path.realpath(str(path))
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def in_use(device: str = "cpu") -> int:
    gc.collect()
    return pinload.pool_stats("sim" if device == "sim" else ("cuda:0" if device == "cuda" else "cpu"))["in_use"]


def memory_cgroup_v1(limit: int, prefix: str = "pinload-test") -> Path:
    """A fresh cgroup v1 memory cgroup capped at `limit` bytes, swap included (the caller removes
    it); skips the test where there is none to make."""
    import uuid

    import pytest

    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    cg = root / f"{prefix}-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup: {e}")
    (cg / "memory.limit_in_bytes").write_text(str(limit))
    memsw = cg / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        memsw.write_text(str(limit))  # no swapping past the limit either
    return cg
