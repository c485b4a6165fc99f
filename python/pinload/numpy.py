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
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _core, _loading
from . import _safetensors_compat as compat
from ._core import InvalidFileError, NotFoundError
from ._options import request
from ._safetensors_compat import deserialize, serialize, serialize_file

__all__ = ["deserialize", "load", "load_file", "safe_open", "save", "save_file", "serialize", "serialize_file"]

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


def _check_host(device: Any, file: Optional[str] = None) -> None:
    if device not in ("cpu", None) and str(device) != "cpu":
        raise compat.error(InvalidFileError, f"numpy arrays live in host memory; device must be 'cpu', not {device!r}",
                           file=file)


def load_file(filename: Any, device: str = "cpu", *, backend: Optional[str] = None,
              **options: Any) -> Dict[str, "np.ndarray"]:
    """Loads a safetensors file into numpy arrays: a drop-in for ``safetensors.numpy.load_file``.

    ``device`` must be "cpu" (numpy arrays live in host memory). ``backend``: "mmap" or "pread",
    how a file already in the page cache is read (default: pinload's choice). Other keyword
    arguments are load options (see pinload.torch). Raises pinload.Error subclasses.
    """
    _check_host(device)
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
    with compat.bytes_as_file(data) as path:
        return load_path(path, **options)


def save(tensors: Dict[str, "np.ndarray"], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """safetensors.numpy.save (the reference writes; needs safetensors)."""
    from safetensors.numpy import save as reference_save

    return reference_save(tensors, metadata=metadata)


def save_file(tensors: Dict[str, "np.ndarray"], filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors.numpy.save_file (the reference writes; needs safetensors)."""
    from safetensors.numpy import save_file as reference_save_file

    reference_save_file(tensors, filename, metadata=metadata)


class _Slice:
    """``safe_open.get_slice``: shape and dtype without a load; indexing (the reference's rules for
    numpy, _safetensors_compat.reference_index) loads the file once and returns a contiguous array."""

    __slots__ = ("_file", "_name")

    def __init__(self, file: "safe_open", name: str) -> None:
        self._file, self._name = file, name

    def get_shape(self) -> List[int]:
        return self._file.get_shape(self._name)

    def get_dtype(self) -> str:
        return self._file.get_dtype(self._name)

    def __getitem__(self, index: Any) -> "np.ndarray":
        whole = self._file.get_tensor(self._name)
        return np.ascontiguousarray(whole[compat.reference_index(index, self.get_shape())])


class safe_open:
    """``safetensors.numpy.safe_open`` (the reference's ``safe_open``) without torch: framework "np"
    gives numpy arrays over pinload's memory, as ``pinload.torch.safe_open(framework="np")`` does;
    any other framework is ``pinload.torch.safe_open``'s (which imports torch). The header is read
    and checked at once and the file held open until ``close()``; the first ``get_tensor`` loads the
    whole file in one parallel sweep. ``backend`` and the load options: as ``load_file``."""

    def __new__(cls, filename: Any, framework: str = "np", device: Any = "cpu", **kwargs: Any) -> Any:
        if framework not in ("np", "numpy"):
            from .torch import safe_open as torch_safe_open

            return torch_safe_open(filename, framework, device, **kwargs)
        return super().__new__(cls)

    def __init__(self, filename: Any, framework: str = "np", device: Any = "cpu", *, backend: Optional[str] = None,
                 progress: bool = False, prefetch: Any = None, options: Any = None, **load_options: Any) -> None:
        self._path = compat.filename_of(filename)
        self._closed = True  # until the header is read
        _check_host(device, self._path)
        self._cached_read = compat.cached_read_of(backend)
        self._request = request(progress=progress, prefetch=prefetch, options=options, **load_options)
        try:
            self._held: Optional[_core.HeldFile] = _core.HeldFile(os.fsencode(self._path))
        except NotFoundError as e:
            raise compat.missing_file(e, self._path) from None
        header = self._held.header()
        self._offset_order: List[str] = [t[0] for t in header["tensors"]]
        self._info: Dict[str, Tuple[str, List[int]]] = {t[0]: (t[1], t[2]) for t in header["tensors"]}
        self._metadata: Optional[Dict[str, str]] = header["metadata"]
        self._lock = threading.Lock()
        self._sd: Optional[_core.StateDict] = None
        self._closed = False

    def __enter__(self) -> "safe_open":
        self._check_open()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drops this handle's reference to the loaded file; arrays handed out stay valid."""
        with self._lock:
            self._closed, self._sd, self._held = True, None, None

    def _check_open(self) -> None:
        if self._closed:
            raise compat.closed(self._path)

    def _info_of(self, name: str) -> Tuple[str, List[int]]:
        self._check_open()
        info = self._info.get(name)
        if info is None:
            raise compat.missing_tensor(self._path, name)
        return info

    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        self._check_open()
        return sorted(self._info)

    def offset_keys(self) -> List[str]:
        """Tensor names in file order (by offset)."""
        self._check_open()
        return list(self._offset_order)

    def metadata(self) -> Optional[Dict[str, str]]:
        self._check_open()
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name: str) -> "np.ndarray":
        dtype, _ = self._info_of(name)
        numpy_dtype(dtype, name, self._path)
        with self._lock:
            self._check_open()
            if self._sd is None:
                self._sd = _loading.wait(_loading.start([self._path], "cpu", self._request,
                                                        cached_read=self._cached_read, held=self._held),
                                         self._request.progress)
            sd = self._sd
        _, dtype, shape, export = sd.export(name)
        return to_numpy(dtype, shape, export, name, self._path)

    def get_tensors(self) -> Dict[str, "np.ndarray"]:
        """Every array, in file order."""
        self._check_open()
        for name in self._offset_order:
            numpy_dtype(self._info[name][0], name, self._path)
        return {name: self.get_tensor(name) for name in self._offset_order}

    def get_slice(self, name: str) -> _Slice:
        self._info_of(name)
        return _Slice(self, name)

    def get_shape(self, name: str) -> List[int]:
        return list(self._info_of(name)[1])

    def get_dtype(self, name: str) -> str:
        return self._info_of(name)[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("loaded" if self._sd is not None else "open")
        return f"<pinload.numpy.safe_open {self._path!r} {len(self._info)} tensors, {state}>"


def __getattr__(name: str) -> Any:  # TensorSpec: the reference's own, where it has one
    return compat.reference_object(__name__, name)
