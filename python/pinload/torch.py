"""PyTorch API: safetensors-compatible loads through pinload, zero-copy.

``load_file`` and ``safe_open`` mirror ``safetensors.torch.load_file`` and ``safetensors.safe_open``;
``load_files`` and ``iter_tensors`` take sharded checkpoints, indexes and folders. Every tensor they
return aliases pinload memory (a block of the device's shared pinned pool, or a device buffer) that
it keeps alive on its own: tensors stay valid after the state dict, the ``safe_open`` handle or the
load that made them is gone, and the memory goes back to the pool when the last tensor over it is
freed. See docs/python.md for the lifetime rules.

Options accepted by every load (keyword-only), checked once by the C++ core (a value out of range
raises :class:`pinload.InvalidArgumentError`, a ``ValueError``, naming the option):

- ``threads`` (8): reader threads; ``block_size`` (8 MiB): bytes per read, an int or "4M";
- ``connections`` (None: ``PINLOAD_CONNECTIONS``, else 16): parallel connections (and readers) for
  remote files (``s3://``, ``http(s)://``; docs/remote.md), 1..1024;
- ``direct`` ("auto" | "on" | "off"): O_DIRECT reads (auto: unless the file is already cached);
- ``files_in_flight`` (2): shards read at once; ``variant``: "fp16" loads ``*.fp16.safetensors``;
- ``streams`` (2), ``chunk_bytes`` (8 MiB): host-to-device copy streams and chunk size;
- ``staging_bytes`` (256 MiB): the pinned staging that device loads stream through (shared by
  every load of one budget);
- ``progress`` (False): a tqdm progress bar on stderr (GB and GB/s, as the CLI's) when the load
  takes over a second on a terminal;
- ``pool_bytes``: the budget of the pool the load's blocks come from (one shared pool per device
  and budget; default: the device's shared pool, no budget). A host load that cannot fit it, or
  the process's memory limit (cgroup, MemAvailable), fails with OutOfMemoryError before reading;
- ``dtype``, ``keep``, ``keep_dtype``: conversion on load (floating tensors to ``dtype``, except
  names matching a ``keep`` pattern);
- or all of these as one ``options=pinload.LoadOptions(...)`` (typed: :class:`pinload.LoadKwargs`);
- ``prefetch``: a ``pinload.prefetch(...)`` handle of the same paths and device, adopted: what it
  has read is not read again (the prefetch's own options then apply).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _core, _file_handle, _loading
from . import _safetensors_compat as _compat
from . import _torch_tensors as _tt
from ._core import Error, InvalidArgumentError, InvalidFileError, IoError, NotFoundError
from ._options import LoadKwargs, LoadOptions, request
from ._safe_open_base import SafeOpen, check_host
from ._safetensors_compat import deserialize, serialize, serialize_file
from ._torch_tensors import DTYPES, SMALL_FILE_BYTES, Device, PathLike

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DTYPES", "deserialize", "iter_tensors", "load", "load_file", "load_files", "load_files_batch", "load_model",
           "safe_open", "safe_open_handle", "save", "save_file", "save_model", "serialize", "serialize_file",
           "storage_ptr", "storage_size"]

_wait = _loading.wait  # tests drive the wait loop directly


def load_file(filename: PathLike, device: Device = "cpu", *, backend: Optional[str] = None, progress: bool = False,
              prefetch: Optional["_core.Prefetch"] = None, options: Optional[LoadOptions] = None,
              **load_options: "Unpack[LoadKwargs]") -> Dict[str, torch.Tensor]:
    """Loads a safetensors file: a drop-in for ``safetensors.torch.load_file``.

    ``device``: "cpu" (the default), "cuda", "cuda:N", an int or a torch.device; "sim" (pinload's
    CPU stand-in device, for tests). Device loads go through pinload's pipelined device target
    (streaming through a shared pinned staging pool of ``staging_bytes``, default
    ``pinload.DEFAULT_STAGING_BYTES``). ``backend``: "mmap" or "pread", how a
    file already in the page cache is read (default: pinload's own choice; a cold file is read with
    O_DIRECT either way); any other value is an error. Returns name -> tensor in file order.
    Options: see the module docstring. Raises pinload.Error subclasses (SafetensorError too).
    """
    path = _compat.filename_of(filename)
    cached_read = _compat.cached_read_of(backend)
    try:
        sd, move_to = _tt.load_paths([path], device, request(progress=progress, prefetch=prefetch, options=options,
                                                    **load_options), cached_read)
    except NotFoundError as e:
        raise _compat.missing_file(e, path) from None
    return dict(_tt.yield_all(sd, move_to, path))


def load(data: bytes, **options: Any) -> Dict[str, torch.Tensor]:
    """Loads a safetensors file from its bytes: a drop-in for ``safetensors.torch.load``.

    The bytes go through pinload's reader and parser like a file's (written to a temporary file
    first, removed before this returns); the tensors do not alias ``data``.
    """
    with _compat.bytes_as_file(data) as path:
        return load_file(path, **options)


def load_model(model: "torch.nn.Module", filename: PathLike, strict: bool = True, device: Device = "cpu", *,
               backend: Optional[str] = None, **options: Any) -> Tuple[List[str], List[str]]:
    """Loads a file into ``model``: a drop-in for ``safetensors.torch.load_model``, the tensors read
    by pinload. Names the model shares (tied weights) are resolved as the reference does (its
    ``_remove_duplicate_names``, where safetensors is installed). Returns (missing, unexpected);
    ``strict``: raise RuntimeError when either is not empty."""
    state_dict = load_file(filename, device=device, backend=backend, **options)
    try:
        from safetensors.torch import _remove_duplicate_names
    except ImportError:
        to_removes: Dict[str, List[str]] = {}
    else:
        to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=list(state_dict.keys()))
    missing_keys, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing_keys)
    for group in to_removes.values():
        for name in group:
            if name not in missing:
                unexpected.append(name)
            else:
                missing.remove(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return sorted(missing), unexpected


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """safetensors.torch.save: pinload reads, the reference writes (needs safetensors)."""
    from safetensors.torch import save as reference_save

    return reference_save(tensors, metadata=metadata)


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors.torch.save_file: pinload reads, the reference writes (needs safetensors)."""
    from safetensors.torch import save_file as reference_save_file

    reference_save_file(tensors, filename, metadata=metadata)


def save_model(model: "torch.nn.Module", filename: str, metadata: Optional[Dict[str, str]] = None,
               force_contiguous: bool = True) -> None:
    """safetensors.torch.save_model: pinload reads, the reference writes (needs safetensors)."""
    from safetensors.torch import save_model as reference_save_model

    reference_save_model(model, filename, metadata=metadata, force_contiguous=force_contiguous)


def storage_ptr(tensor: torch.Tensor) -> int:
    """safetensors.torch.storage_ptr (the reference's own; needs safetensors)."""
    from safetensors.torch import storage_ptr as reference

    return reference(tensor)


def storage_size(tensor: torch.Tensor) -> int:
    """safetensors.torch.storage_size (the reference's own; needs safetensors)."""
    from safetensors.torch import storage_size as reference

    return reference(tensor)


def load_files(index_or_paths: Union[PathLike, Sequence[PathLike]], device: Device = "cpu", *,
               progress: bool = False, prefetch: Optional["_core.Prefetch"] = None,
               options: Optional[LoadOptions] = None, **load_options: "Unpack[LoadKwargs]") -> Dict[str, torch.Tensor]:
    """Loads a sharded checkpoint: files, ``*.safetensors.index.json`` indexes, model folders or
    diffusers pipeline folders (whose tensors are named ``component/name``), in one parallel load.

    Returns name -> tensor in load order. Options: see the module docstring.
    """
    req = request(progress=progress, prefetch=prefetch, options=options, **load_options)
    return dict(_tt.iterate(_loading.as_paths(index_or_paths), device, req))


def load_files_batch(paths: Sequence[PathLike], device: Device = "cpu", *, return_errors: bool = False,
                     backend: Optional[str] = None, options: Optional[LoadOptions] = None,
                     **load_options: "Unpack[LoadKwargs]") -> Dict[str, Any]:
    """Loads many independent checkpoints (a library of LoRA files) in one parallel sweep: the same
    state dicts as ``{p: load_file(p) for p in paths}``, at a fraction of the per-call cost.

    Each path is a file, an index or a folder, as ``load_files`` takes one alone; tensor names are
    those of a load of that path alone (paths whose tensors share names are fine). Returns
    path -> (name -> tensor), in the order given, keyed by the path as ``os.fsdecode`` spells it; a
    path given twice raises ValueError. Headers are read ``threads`` at once and ``threads`` files are
    read at once (Note [Small files] in include/pinload/batch.h).

    Errors: one path's failure is that path's alone, and no state dict is ever partial. By default
    the first failing path (in the order given) raises its own pinload.Error (naming the file), after
    the batch, and nothing is returned; ``errors`` on that exception maps every failing path to its
    error. With ``return_errors=True`` nothing is raised for a failing path: its value is its error
    instead of a state dict (as ``asyncio.gather(return_exceptions=True)``). Ctrl-C cancels the batch
    (KeyboardInterrupt). ``backend`` and the options: as ``load_file``; the dtype conversion options
    (``dtype``, ``keep``) and ``prefetch`` are not taken here.
    """
    names = _loading.as_paths(paths)
    seen: set = set()
    for p in names:
        if p in seen:
            raise ValueError(f"path given twice: {p!r}")
        seen.add(p)
    req = request(options=options, **load_options)
    if req.options.dtype is not None:
        raise TypeError("load_files_batch takes no dtype/keep/keep_dtype options")
    cached_read = _compat.cached_read_of(backend)
    spec, move_to = _tt.resolve_device(device)
    entries = _core.load_batch([os.fsencode(p) for p in names], spec, req.options, cached_read=cached_read)
    out: Dict[str, Any] = {}
    failed: Dict[str, BaseException] = {}
    entry: Any
    for p, entry in zip(names, entries):
        if not isinstance(entry, BaseException):
            try:
                entry = dict(_tt.yield_all(entry, move_to, p))
            except _core.Error as e:  # a dtype torch cannot hold: this path's error too
                entry = e
        if isinstance(entry, BaseException):
            failed[p] = entry
        out[p] = entry
    if failed and not return_errors:
        first = next(iter(failed.values()))
        first.errors = failed  # type: ignore[attr-defined]
        # The traceback holds this frame: the good members' tensors must not live on through it
        # until the cycle collector runs.
        del out, entries, entry
        raise first
    return out


def iter_tensors(paths: Union[PathLike, Sequence[PathLike]], device: Device = "cpu", *,
                 progress: bool = False, prefetch: Optional["_core.Prefetch"] = None,
                 options: Optional[LoadOptions] = None,
                 **load_options: "Unpack[LoadKwargs]") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of ``paths`` (as ``load_files`` takes them) as its
    bytes arrive: the contract of vLLM's ``load_weights(weights: Iterable[tuple[str, Tensor]])``.

    One parallel load runs in the background; a host tensor is yielded as soon as the reads that
    hold it have completed (roughly in file order; shards read at once interleave), a device tensor
    once the load's copies are done. Closing the iterator early, or an error, cancels the load; an
    error is raised after the tensors already yielded. A file's pool block returns to the pool once
    every tensor of that file has been dropped by the caller. The load starts on the first
    ``next()``.
    """
    req = request(progress=progress, prefetch=prefetch, options=options, **load_options)
    return _tt.stream_tensors(_loading.as_paths(paths), device, req)


# ---- safe_open ----


class safe_open(SafeOpen):
    """Opens a safetensors file: a drop-in for ``safetensors.safe_open(filename, framework="pt")``.

    The header is read and checked at once (a missing file raises NotFoundError, a bad one
    InvalidFileError), and the file is held open until ``close()``: a path replaced meanwhile does
    not change what is read. The first ``get_tensor``/``get_tensors`` (or slice indexing) loads the
    whole file in one parallel sweep into the device's shared pool; later calls alias that load.
    Tensors stay valid after the handle is closed. Usable as a context manager; thread-safe.

    ``framework``: "pt" (torch tensors) or "np"/"numpy" (numpy arrays over the same memory, no
    copy). ``device``: as ``load_file`` ("cpu" only for numpy). ``backend``: "mmap" or "pread", as
    ``load_file``; anything else is an error. Other keyword arguments are load options (see the
    module docstring). Errors are worded as the reference's (a closed handle: "File is closed"; a
    missing tensor: "File does not contain tensor X"; a missing file: "No such file or directory:
    X") and are pinload.Error subclasses, SafetensorError too where safetensors is installed.
    """

    def __init__(self, filename: PathLike, framework: str = "pt", device: Device = "cpu", *,
                 backend: Optional[str] = None, progress: bool = False,
                 prefetch: Optional["_core.Prefetch"] = None, options: Optional[LoadOptions] = None,
                 **load_options: "Unpack[LoadKwargs]") -> None:
        super().__init__(filename, framework, device, backend=backend, progress=progress, prefetch=prefetch,
                         options=options, **load_options)

    def _framework(self, framework: str, device: Any) -> bool:
        if framework in ("np", "numpy"):
            check_host(device, self._path)
            return True
        if framework in ("pt", "torch", "pytorch"):
            return False
        raise _tt.error(InvalidFileError,
                        f"framework {framework!r} is not supported: pinload returns torch tensors (framework='pt') "
                        "or numpy arrays (framework='np')",
                        file=self._path)

    def _opening(self) -> None:
        spec, _ = _tt.resolve_device(self._device)
        if spec != "cpu":
            _core.pool_stats(spec)  # opens the device now: an unusable one fails here, not at get_tensor

    def _load(self) -> Tuple["_core.StateDict", Optional[torch.device]]:
        """Loads the file (a hook for subclasses: pinload.hooks serves it from a ModelCache)."""
        return _tt.load_paths([self._path], self._device, self._request, self._cached_read, self._held)

    def _check_tensor(self, dtype: str, shape: List[int], name: str) -> None:
        if self._numpy:
            super()._check_tensor(dtype, shape, name)
        else:
            _tt.torch_dtype(dtype, name, self._path)
        _tt.torch_shape(dtype, shape, name, self._path)

    def _tensor(self, sd: "_core.StateDict", name: str) -> Any:
        if self._numpy:
            return super()._tensor(sd, name)
        _, dtype, shape, export = sd.export(name)
        return _tt.to_torch(dtype, shape, export, sd.torch_device, self._move_to, name, self._path)


# safe_open over an open file object (safetensors' _safe_open_handle): Note [Handles] in _file_handle.py.
class safe_open_handle(safe_open):
    """``safe_open`` (pinload.torch.safe_open, same methods and options) over an open file object
    instead of a path (Note [Handles] above). Holds a descriptor of its own until ``close()``."""

    def __init__(self, f: Any, framework: str = "pt", device: Device = "cpu", **options: Any) -> None:
        fd = _file_handle.descriptor(f)
        # A descriptor of the handle's own: its /proc/self/fd path stays valid (and names the same
        # file) until close(), whatever happens to the object.
        self._own_fd: Optional[int] = os.dup(fd) if fd is not None else _file_handle.copy_to_memory_file(f)
        try:
            super().__init__(f"/proc/self/fd/{self._own_fd}", framework, device, **options)
        except BaseException:
            self._close_fd()
            raise

    def _close_fd(self) -> None:
        fd, self._own_fd = getattr(self, "_own_fd", None), None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        super().close()
        with self._lock:
            self._close_fd()

    def __del__(self) -> None:
        self._close_fd()


# TensorSpec and SafetensorError: the reference's own classes, where the installed safetensors has
# them (serialize takes TensorSpecs; pinload's errors are SafetensorErrors).
try:
    from safetensors import SafetensorError  # noqa: F401
except ImportError:
    pass
try:
    from safetensors import TensorSpec  # noqa: F401
except ImportError:
    pass
