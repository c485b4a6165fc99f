"""NumPy API: a drop-in for ``safetensors.numpy`` through pinload, without torch.

``load_file`` and ``load`` return numpy arrays that alias pinload's pool memory (zero-copy: one
block per file, kept alive by the arrays; it goes back to the pool once the last array over it is
freed). ``save_file`` and ``save`` are safetensors' own (``safetensors.numpy``): pinload reads,
the reference writes; they need safetensors installed.

dtypes: those numpy has (bool, int and uint 8..64, float16/32/64, complex64); BF16 and the F8 types
need ``ml_dtypes``; sub-byte types (F4, F6) raise InvalidFileError naming the tensor.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Optional

import numpy as np

from . import _core, _loading
from . import _safetensors_compat as compat
from ._core import InvalidFileError, NotFoundError
from ._options import request

__all__ = ["load", "load_file", "save", "save_file"]

_NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
    "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "C64": np.complex64,
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}


def numpy_dtype(dtype: str, tensor: str, file: Optional[str]) -> "np.dtype":
    """The numpy dtype of a safetensors dtype, or InvalidFileError naming the tensor."""
    if dtype in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[dtype])
    if dtype in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            pass
        else:
            if hasattr(ml_dtypes, _ML_DTYPES[dtype]):
                return np.dtype(getattr(ml_dtypes, _ML_DTYPES[dtype]))
        why = "needs the ml_dtypes package"
    else:
        why = "has no numpy equivalent"
    raise compat.error(InvalidFileError, f"dtype {dtype} {why}; pinload cannot return it as a numpy array",
                       file=file, tensor=tensor)


class _Exported:
    """A capsule with the DLPack protocol methods numpy.from_dlpack asks for (host memory)."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple:
        return (1, 0)  # kDLCPU


def to_numpy(dtype: str, shape: list, capsule: Any, name: str, file: Optional[str]) -> "np.ndarray":
    """An array over an exported tensor's bytes (no copy); ``capsule`` None: no bytes. A
    pinload TensorExport goes out as its bytes (``as_bytes()``), viewed as the numpy dtype."""
    np_dtype = numpy_dtype(dtype, name, file)
    if capsule is None:
        return np.empty(shape, dtype=np_dtype)
    if hasattr(capsule, "as_bytes"):
        capsule = capsule.as_bytes()
    raw = capsule if hasattr(capsule, "__dlpack__") else _Exported(capsule)
    array = np.from_dlpack(raw)
    return array.reshape(-1).view(np.uint8).view(np_dtype).reshape(shape)


def _arrays(sd: "_core.StateDict", file: str) -> Dict[str, "np.ndarray"]:
    for name, dtype, _shape in sd.infos():
        numpy_dtype(dtype, name, file)
    return {name: to_numpy(dtype, shape, capsule, name, file) for name, dtype, shape, capsule in sd.export_all()}


def load_file(filename: Any, device: str = "cpu", *, backend: Optional[str] = None,
              **options: Any) -> Dict[str, "np.ndarray"]:
    """Loads a safetensors file into numpy arrays: a drop-in for ``safetensors.numpy.load_file``.

    ``device`` must be "cpu" (numpy arrays live in host memory). ``backend``: "mmap" or "pread",
    how a file already in the page cache is read (default: pinload's choice). Other keyword
    arguments are load options (see pinload.torch). Raises pinload.Error subclasses.
    """
    if device != "cpu":
        raise compat.error(InvalidFileError, f"numpy arrays live in host memory; device must be 'cpu', not {device!r}")
    path = compat.filename_of(filename)
    cached_read = compat.cached_read_of(backend)
    req = request(**options)
    try:
        sd = _loading.wait(_loading.start([path], "cpu", req, cached_read=cached_read), req.progress)
    except NotFoundError as e:
        raise compat.missing_file(e, path) from None
    return _arrays(sd, path)


def load(data: bytes, **options: Any) -> Dict[str, "np.ndarray"]:
    """Loads a safetensors file from its bytes: a drop-in for ``safetensors.numpy.load``.

    The bytes go through pinload's reader and parser like a file's (they are written to a
    temporary file first, removed before this returns); the arrays do not alias ``data``.
    """
    return _load_bytes(data, load_file, **options)


def _load_bytes(data: Any, load_path: Any, **options: Any) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="pinload-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return load_path(path, **options)
    finally:
        os.unlink(path)


def save(tensors: Dict[str, "np.ndarray"], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """safetensors.numpy.save (the reference writes; needs safetensors)."""
    from safetensors.numpy import save as reference_save

    return reference_save(tensors, metadata=metadata)


def save_file(tensors: Dict[str, "np.ndarray"], filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors.numpy.save_file (the reference writes; needs safetensors)."""
    from safetensors.numpy import save_file as reference_save_file

    reference_save_file(tensors, filename, metadata=metadata)
