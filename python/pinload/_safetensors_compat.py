"""What pinload's drop-in (``safe_open``, ``load_file``, ``load``) shares with the reference
safetensors 0.8 beyond tensors: the keyword arguments, the slicing rules of ``get_slice`` and the
wording of its errors, so that code (and safetensors' own test suite,
tests/python/safetensors_suite) written against the reference runs unchanged.

Errors stay pinload errors (``pinload.Error`` subclasses, with ``.file`` and ``.tensor``); where
safetensors is installed they are ``safetensors.SafetensorError`` too (Note [SafetensorError] in
src/python/errors.cc). Imports neither torch nor numpy.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from ._core import Error, InvalidFileError, NotFoundError

#: safe_open(backend=...) -> how pinload reads a file found in the page cache (cold files are
#: read with O_DIRECT either way): "mmap" copies from a mapping, "pread" reads with pread(2);
#: None (not given): pinload's own choice, "auto" (docs/tuning.md).
BACKENDS = {None: "auto", "mmap": "map", "pread": "pread"}


def cached_read_of(backend: Optional[str]) -> str:
    """The pinload cached-read mode for a safetensors ``backend``; anything else is an error."""
    if isinstance(backend, str) and backend in BACKENDS:
        return BACKENDS[backend]
    if backend is None:
        return "auto"
    raise error(InvalidFileError, f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')


def error(cls, message: str, *, file: Optional[str] = None, tensor: Optional[str] = None,
          text: Optional[str] = None):
    """An instance of a pinload error class: str() is ``text`` where given (the reference's
    wording), else formatted as the C++ core does; ``.file``, ``.tensor``, ``.message`` set."""
    if text is None:
        text = (f"{file}: " if file else "") + (f"tensor '{tensor}': " if tensor else "") + message
    e = cls(text)
    e.file, e.tensor, e.message = file, tensor, message
    return e


def filename_of(filename: Any) -> str:
    """A path argument as str. bytes are a path (as os.fsdecode takes them), unless they hold a NUL,
    which no path can: then they are the contents of a file, which ``load(data)`` takes."""
    if isinstance(filename, bytes):
        if b"\0" in filename:
            raise TypeError("filename is bytes with a NUL in them: the contents of a file, not a path; "
                            "use pinload.torch.load(data) or pinload.numpy.load(data) for those")
        return os.fsdecode(filename)
    if isinstance(filename, (str, os.PathLike)):
        return os.fsdecode(os.fspath(filename))
    raise TypeError(f"filename must be a str or os.PathLike, not {type(filename).__name__}")


REMOTE_PREFIXES = ("s3://", "http://", "https://")


def missing_file(e: NotFoundError, path: str) -> NotFoundError:
    """The reference's error for a file that does not exist: 'No such file or directory: <path>'.
    A remote path keeps pinload's message, which has the server's reason (NoSuchKey, NoSuchBucket,
    HTTP 404/410): the reference cannot open those at all; so does a path that exists (a folder
    that holds no .safetensors file), which the reference's message would deny."""
    if path.startswith(REMOTE_PREFIXES) or os.path.lexists(path):
        return e
    if getattr(e, "tensor", None) is None and getattr(e, "file", None) == path:
        return error(NotFoundError, "no such file or folder", file=path, text=f"No such file or directory: {path}")
    return e


def missing_tensor(path: str, name: str) -> NotFoundError:
    return error(NotFoundError, "no such tensor in the file", file=path, tensor=name,
                 text=f"File does not contain tensor {name}")


def closed(path: str) -> Error:
    return error(Error, "file is closed", file=path, text="File is closed")


def _slicing_error(message: str) -> Error:
    return error(InvalidFileError, message, text=message)


def _index_text(parts: List[Tuple[str, Any]]) -> str:
    out = []
    for kind, value in parts:
        if kind == "select":
            out.append(str(value))
        else:
            start, stop, step = value
            text = f"{'' if start is None else start}:{'' if stop is None else stop}"
            out.append(text if step == 1 else f"{text}:{step}")
    return "[" + ", ".join(out) + "]"


def reference_index(index: Any, shape: List[int]) -> Union[Tuple[Any, ...], List[Any]]:
    """The Python index equivalent to ``get_slice(name)[index]`` under the reference's rules, or the
    reference's error: ints, slices with non-negative bounds and a positive step, one ``...``, an
    empty list; an index past a dimension's end is an error (not clipped, as Python would); a
    negative int counts from the end."""
    if isinstance(index, tuple):
        items = list(index)
    elif isinstance(index, list):
        if not index:
            items = [slice(0, 0)]
        else:
            raise _slicing_error("Non empty lists are not implemented")
    else:
        items = [index]
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise _slicing_error("Only one ellipsis (...) is allowed in slice index")
    n_expansion = max(0, len(shape) - (len(items) - sum(1 for it in items if it is Ellipsis)))
    parts: List[Tuple[str, Any]] = []
    for it in items:
        dim_idx = len(parts)
        if it is Ellipsis:
            parts.extend([("narrow", (None, None, 1))] * n_expansion)
        elif isinstance(it, slice):
            for bound in (it.start, it.stop):
                if bound is not None and (not isinstance(bound, int) or bound < 0):
                    raise OverflowError(f"slice bounds must be non-negative integers, not {bound!r}")
            step = 1 if it.step is None else it.step
            if not isinstance(step, int) or step <= 0:
                raise _slicing_error(f"Slice step must be a positive integer, got {step}")
            parts.append(("narrow", (it.start, it.stop, step)))
        elif isinstance(it, int):
            dim = shape[dim_idx] if dim_idx < len(shape) else 0
            if it < 0:
                if dim + it < 0:
                    raise _slicing_error(f"Invalid index {it} for dimension {dim_idx} of size {dim}")
                it = dim + it
            parts.append(("select", it))
        else:
            raise _slicing_error(f"Unsupported slice index at position {dim_idx}: expected slice, int, or ellipsis")
    if len(parts) > len(shape):
        raise _slicing_error(f"Error during slicing {_index_text(parts)} with shape {list(shape)}: "
                             "more slicing indexes than dimensions in tensor")
    out: List[Any] = []
    # The reference checks the dimensions from the last to the first.
    for i in reversed(range(len(parts))):
        kind, value = parts[i]
        dim = shape[i]
        if kind == "select":
            start, stop = value, value + 1
        else:
            start = 0 if value[0] is None else value[0]
            stop = dim if value[1] is None else value[1]
        if start >= dim or stop > dim:
            asked = start if start >= dim else max(stop - 1, 0)
            raise _slicing_error(f"Error during slicing {_index_text(parts)} with shape {list(shape)}: "
                                 f"index {asked} out of bounds for tensor dimension #{i} of size {dim}")
        out.append(value if kind == "select" else slice(start, max(start, stop), value[2]))
    return tuple(reversed(out))


# ---- bytes in memory (load(data), deserialize(data)) ----

BYTES = "<bytes>"  # what errors name instead of the temporary file


@contextlib.contextmanager
def bytes_as_file(data: Any) -> Iterator[str]:
    """A temporary file (in /dev/shm where it can) holding ``data``, removed on exit, for pinload's
    reader and parser, which take paths. An error raised inside names ``<bytes>``, never the
    temporary file: it is an internal name the caller never gave."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="pinload-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            yield path
        except Error as e:
            raise _renamed(e, path) from None
    finally:
        os.unlink(path)


def _renamed(e: Error, path: str) -> Error:
    text = str(e).replace(path, BYTES)
    out = type(e)(text)
    message = getattr(e, "message", None)
    out.file = BYTES if getattr(e, "file", None) == path else getattr(e, "file", None)
    out.tensor = getattr(e, "tensor", None)
    out.message = message.replace(path, BYTES) if isinstance(message, str) else message
    for attr in ("offset", "errno"):
        if hasattr(e, attr):
            setattr(out, attr, getattr(e, attr))
    return out


def deserialize(data: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """``safetensors.deserialize``: [(name, {"shape", "dtype", "data": bytearray})] in file order, the
    header parsed and checked by pinload's parser (include/pinload/safetensors.h)."""
    from . import _core

    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    with bytes_as_file(view) as path:
        header = _core.read_header(os.fsencode(path))
    start = header["data_offset"]
    return [(name, {"shape": list(shape), "dtype": dtype, "data": bytearray(view[start + begin:start + end])})
            for name, dtype, shape, begin, end in header["tensors"]]


# ---- writers and the rest of the reference's API: the reference's own ----


def serialize(tensor_dict: Dict[str, Any], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """``safetensors.serialize`` (the reference writes; needs safetensors)."""
    from safetensors import serialize as reference

    return reference(tensor_dict, metadata=metadata)


def serialize_file(tensor_dict: Dict[str, Any], filename: Any, metadata: Optional[Dict[str, str]] = None) -> None:
    """``safetensors.serialize_file`` (the reference writes; needs safetensors)."""
    from safetensors import serialize_file as reference

    return reference(tensor_dict, filename, metadata=metadata)


#: Names of the reference's API served as the reference's own objects (classes), where the installed
#: safetensors has them: module ``__getattr__``s of pinload, pinload.torch and pinload.numpy ask here.
REFERENCE_OBJECTS = ("TensorSpec", "SafetensorError")


def reference_object(module: str, name: str) -> Any:
    """``safetensors.<name>``, or AttributeError naming ``module`` where safetensors lacks it."""
    if name in REFERENCE_OBJECTS:
        try:
            import safetensors
        except ImportError:
            pass
        else:
            if hasattr(safetensors, name):
                return getattr(safetensors, name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
