"""NumPy API: a drop-in for ``safetensors.numpy`` through pinload, without torch.

``load_file`` and ``load`` return numpy arrays that alias pinload's pool memory (zero-copy: one
block per file, kept alive by the arrays; it goes back to the pool once the last array over it is
freed). ``save_file`` and ``save`` are safetensors' own (``safetensors.numpy``): pinload reads,
the reference writes; they need safetensors installed.

dtypes: those numpy has (bool, int and uint 8..64, float16/32/64, complex64); BF16 and the F8 types
need ``ml_dtypes``; sub-byte types (F4, F6) raise InvalidFileError naming the tensor.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from . import _core, _loading
from . import _safetensors_compat as compat
from ._core import NotFoundError
from ._options import request
from ._safe_open_base import SafeOpen, check_host, numpy_dtype, to_numpy
from ._safetensors_compat import deserialize, serialize, serialize_file

__all__ = ["deserialize", "load", "load_file", "safe_open", "save", "save_file", "serialize", "serialize_file"]


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
    check_host(device)
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
    with compat.bytes_as_file(data) as path:
        return load_file(path, **options)


def save(tensors: Dict[str, "np.ndarray"], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """safetensors.numpy.save (the reference writes; needs safetensors)."""
    from safetensors.numpy import save as reference_save

    return reference_save(tensors, metadata=metadata)


def save_file(tensors: Dict[str, "np.ndarray"], filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors.numpy.save_file (the reference writes; needs safetensors)."""
    from safetensors.numpy import save_file as reference_save_file

    reference_save_file(tensors, filename, metadata=metadata)


class safe_open(SafeOpen):
    """``safetensors.numpy.safe_open`` (the reference's ``safe_open``) without torch: framework "np"
    gives numpy arrays over pinload's memory, as ``pinload.torch.safe_open(framework="np")`` does;
    any other framework is ``pinload.torch.safe_open``'s (which imports torch). The header is read
    and checked at once and the file held open until ``close()``; the first ``get_tensor`` loads the
    whole file in one parallel sweep. ``backend`` and the load options: as ``load_file``."""

    _repr_name = "pinload.numpy.safe_open"

    def __new__(cls, filename: Any, framework: str = "np", device: Any = "cpu", **kwargs: Any) -> Any:
        if framework not in ("np", "numpy"):
            from .torch import safe_open as torch_safe_open

            return torch_safe_open(filename, framework, device, **kwargs)
        return super().__new__(cls)

    def __init__(self, filename: Any, framework: str = "np", device: Any = "cpu", **options: Any) -> None:
        super().__init__(filename, framework, device, **options)

    def _framework(self, framework: str, device: Any) -> bool:
        check_host(device, self._path)
        return True


def __getattr__(name: str) -> Any:  # TensorSpec: the reference's own, where it has one
    return compat.reference_object(__name__, name)
