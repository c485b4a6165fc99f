"""The descriptor of an open Python file object, for ``pinload.torch.safe_open_handle``: a drop-in
for safetensors' private ``_safe_open_handle(f, framework, device)``.

Note [Handles]
A file object with a working ``fileno()`` (``open(...)`` in any mode, fsspec's local files) is read
through its descriptor: the handle opens ``/proc/self/fd/<fileno>``, a new open file of the same
inode, and holds it as ``safe_open`` holds a path (Note [Holding a file] in
include/pinload/env.h), so header and data come from the one file the object has open, even after
its path is replaced or the object is closed. The object's position is not used or moved.
Any other object that can ``seek`` and ``read`` (``io.BytesIO``, remote fsspec files) is read
whole, from its start, into an anonymous in-memory file (``memfd_create``), read the same way. The handle keeps a descriptor of its own (a dup, or the memfd) until
``close()``, which its ``/proc/self/fd/<n>`` path names; errors name that path. An object that can
do neither raises InvalidFileError (SafetensorError too where safetensors is installed) saying why.
"""

from __future__ import annotations

import io
import os
from typing import Any

from ._core import InvalidFileError
from ._torch_tensors import error as _error

__all__ = ["copy_to_memory_file", "descriptor"]


def descriptor(handle: Any):
    fileno = getattr(handle, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
    except (OSError, io.UnsupportedOperation, ValueError):
        return None  # no descriptor (BytesIO), or a closed file: read() says which
    return fd if isinstance(fd, int) and fd >= 0 else None


def copy_to_memory_file(handle: Any) -> int:
    """The object's bytes from its start, in a memfd; returns the descriptor (the caller closes it)."""
    what = type(handle).__name__
    if not callable(getattr(handle, "read", None)):
        raise _error(InvalidFileError, f"cannot read a {what}: it has neither fileno() nor read()")
    try:
        if callable(getattr(handle, "seek", None)):
            handle.seek(0)
        data = handle.read()
    except (OSError, io.UnsupportedOperation, ValueError) as e:
        raise _error(InvalidFileError, f"cannot read the safetensors bytes of a {what}: {e}") from None
    if isinstance(data, str):
        raise _error(InvalidFileError, f"a {what} opened in text mode without a descriptor: open it with 'rb'")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _error(InvalidFileError, f"{what}.read() returned {type(data).__name__}, not bytes")
    fd = os.memfd_create("pinload-handle", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd
