"""What ``pinload.numpy.safe_open`` and ``pinload.torch.safe_open`` share: the handle (header read
and checked at open, the file held until ``close()``, the whole file loaded once at the first
``get_tensor``), its slices, and the numpy flavour's arrays. Each module specialises ``SafeOpen``
with the frameworks it takes and how it loads; neither imports the other for it. Imports neither
torch nor numpy until an array is asked for.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from . import _core, _loading
from . import _safetensors_compat as compat
from ._core import InvalidFileError, IoError, NotFoundError
from ._options import request

_NUMPY_DTYPES = {
    "BOOL": "bool_", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "F32": "float32", "F64": "float64",
    "C64": "complex64",
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}


def numpy_dtype(dtype: str, tensor: str, file: Optional[str]) -> Any:
    """The numpy dtype of a safetensors dtype, or InvalidFileError naming the tensor."""
    import numpy as np

    if dtype in _NUMPY_DTYPES:
        return np.dtype(getattr(np, _NUMPY_DTYPES[dtype]))
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


def to_numpy(dtype: str, shape: list, capsule: Any, name: str, file: Optional[str]) -> Any:
    """An array over an exported tensor's bytes (no copy); ``capsule`` None: no bytes. A
    pinload TensorExport goes out as its bytes (``as_bytes()``), viewed as the numpy dtype."""
    import numpy as np

    np_dtype = numpy_dtype(dtype, name, file)
    if capsule is None:
        return np.empty(shape, dtype=np_dtype)
    if hasattr(capsule, "as_bytes"):
        capsule = capsule.as_bytes()
    raw = capsule if hasattr(capsule, "__dlpack__") else _Exported(capsule)
    array = np.from_dlpack(raw)
    return array.reshape(-1).view(np.uint8).view(np_dtype).reshape(shape)


def check_host(device: Any, file: Optional[str] = None) -> None:
    """numpy arrays live in host memory: any device but "cpu" is an InvalidFileError."""
    if device not in ("cpu", None) and str(device) != "cpu":
        raise compat.error(InvalidFileError, f"numpy arrays live in host memory; device must be 'cpu', not {device!r}",
                           file=file)


class Slice:
    """What ``safe_open.get_slice`` returns: shape and dtype without a load; indexing loads the file
    (once) and returns the indexed part, contiguous: the reference's own rules for numpy arrays (an
    index past a dimension's end is an error; see _safetensors_compat), torch's for tensors."""

    __slots__ = ("_file", "_name")

    def __init__(self, file: "SafeOpen", name: str) -> None:
        self._file = file
        self._name = name

    def get_shape(self) -> List[int]:
        return self._file.get_shape(self._name)

    def get_dtype(self) -> str:
        return self._file.get_dtype(self._name)

    def __getitem__(self, index: Any) -> Any:
        whole = self._file.get_tensor(self._name)
        if self._file._numpy:
            import numpy as np

            return np.ascontiguousarray(whole[compat.reference_index(index, self.get_shape())])
        return whole[index].contiguous()  # torch's indexing, as the reference's "pt" slices

    def __repr__(self) -> str:
        return f"<pinload slice {self._name!r} {self.get_dtype()} {self.get_shape()}>"


class SafeOpen:
    """The safetensors ``safe_open`` handle. A flavour says which frameworks it takes
    (``_framework``), how a tensor is checked and made (``_check_tensor``, ``_tensor``) and how the
    file is loaded (``_load``); the numpy flavour of each is here."""

    _repr_name = "pinload.safe_open"

    def __init__(self, filename: Any, framework: str, device: Any = "cpu", *, backend: Optional[str] = None,
                 progress: bool = False, prefetch: Any = None, options: Any = None, **load_options: Any) -> None:
        self._path = compat.filename_of(filename)
        self._closed = True  # until the header is read
        self._numpy = self._framework(framework, device)
        self._cached_read = compat.cached_read_of(backend)
        self._device = device
        self._request = request(progress=progress, prefetch=prefetch, options=options, **load_options)
        self._opening()
        # Held open until close(): get_tensor reads the file whose header this is, even after the path
        # is replaced (Note [Holding a file] in include/pinload/env.h), as the reference does. A
        # remote object (s3://, http(s)://; docs/remote.md) cannot be held: its header is read now and
        # the load checks that the object it reads still has that header.
        self._held: Optional[_core.HeldFile] = None
        try:
            if self._path.startswith(compat.REMOTE_PREFIXES):
                header = _core.read_header(os.fsencode(self._path), self._request.options)
            else:
                self._held = _core.HeldFile(os.fsencode(self._path))
                header = self._held.header()
        except NotFoundError as e:
            raise compat.missing_file(e, self._path) from None
        self._offset_order: List[str] = [t[0] for t in header["tensors"]]
        self._info: Dict[str, Tuple[str, List[int]]] = {t[0]: (t[1], t[2]) for t in header["tensors"]}
        self._metadata: Optional[Dict[str, str]] = header["metadata"]
        self._lock = threading.Lock()
        self._sd: Optional[_core.StateDict] = None
        self._move_to: Any = None
        self._closed = False

    # ---- what a flavour says ----
    def _framework(self, framework: str, device: Any) -> bool:
        """Checks `framework` and `device`; True where the handle gives numpy arrays."""
        raise NotImplementedError

    def _opening(self) -> None:
        """Called before the header is read (the torch flavour opens its device there)."""

    def _load(self) -> Tuple["_core.StateDict", Any]:
        """Loads the file: the state dict and where its tensors then move (None: nowhere)."""
        sd = _loading.wait(_loading.start([self._path], "cpu", self._request, cached_read=self._cached_read,
                                          held=self._held), self._request.progress)
        return sd, None

    def _loaded(self) -> None:
        """Called once, under the handle's lock, after the file has been loaded (a hook for
        subclasses: pinload.hooks counts loads with it)."""

    def _check_tensor(self, dtype: str, shape: List[int], name: str) -> None:
        numpy_dtype(dtype, name, self._path)

    def _tensor(self, sd: "_core.StateDict", name: str) -> Any:
        _, dtype, shape, export = sd.export(name)
        return to_numpy(dtype, shape, export, name, self._path)

    # ---- the handle ----
    def __enter__(self) -> "SafeOpen":
        self._check_open()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drops this handle's reference to the loaded file; what it handed out stays valid."""
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

    def _state_dict(self) -> "_core.StateDict":
        with self._lock:
            self._check_open()
            if self._sd is None:
                sd, move_to = self._load()
                # Names and shapes (a dtype= load converts the dtypes).
                if self._held is None and ({n: list(s) for n, _, s in sd.infos()} !=
                                           {n: list(s) for n, (_, s) in self._info.items()}):
                    raise compat.error(IoError, "the object changed since safe_open read its header: reopen it",
                                       file=self._path)
                self._sd, self._move_to = sd, move_to
                self._loaded()
            return self._sd

    # ---- safetensors' API ----
    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        self._check_open()
        return sorted(self._info)

    def offset_keys(self) -> List[str]:
        """Tensor names in file order (by offset)."""
        self._check_open()
        return list(self._offset_order)

    def metadata(self) -> Optional[Dict[str, str]]:
        """The file's ``__metadata__``, or None when it has none."""
        self._check_open()
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name: str) -> Any:
        """The tensor (framework "pt") or array (framework "np") ``name``."""
        dtype, shape = self._info_of(name)
        self._check_tensor(dtype, shape, name)
        return self._tensor(self._state_dict(), name)

    def get_tensors(self) -> Dict[str, Any]:
        """Every tensor, in file order."""
        self._check_open()
        for name in self._offset_order:
            self._check_tensor(self._info[name][0], self._info[name][1], name)
        return {name: self.get_tensor(name) for name in self._offset_order}

    def get_slice(self, name: str) -> Slice:
        self._info_of(name)
        return Slice(self, name)

    # ---- pinload extras ----
    def get_shape(self, name: str) -> List[int]:
        return list(self._info_of(name)[1])

    def get_dtype(self, name: str) -> str:
        """The safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self._info_of(name)[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("loaded" if self._sd is not None else "open")
        return f"<{self._repr_name} {self._path!r} {len(self._info)} tensors, {state}>"

