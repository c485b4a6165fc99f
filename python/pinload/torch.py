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

import collections
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _core, _devices, _loading
from . import _safetensors_compat as _compat
from ._core import Error, InvalidArgumentError, InvalidFileError, IoError, NotFoundError
from ._options import LoadKwargs, LoadOptions, Request, request
from ._safetensors_compat import deserialize, serialize, serialize_file

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DTYPES", "deserialize", "iter_tensors", "load", "load_file", "load_files", "load_files_batch", "load_model",
           "safe_open", "safe_open_handle", "save", "save_file", "save_model", "serialize", "serialize_file",
           "storage_ptr", "storage_size"]

PathLike = Union[str, "os.PathLike[str]", bytes]
Device = Union[str, int, "torch.device", None]

# ---- dtypes ----


def _build_dtypes() -> Dict[str, Optional[torch.dtype]]:
    table: Dict[str, Optional[torch.dtype]] = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "C64": torch.complex64,
    }
    # Types that only newer torch versions have; None where this one lacks them.
    optional = {
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    for name, attr in optional.items():
        table[name] = getattr(torch, attr, None)
    # F4 as torch packs it, two to a byte: the last dimension is halved (_torch_shape), as the
    # reference does. F6 has no torch equivalent (the reference refuses it too).
    table["F4"] = getattr(torch, "float4_e2m1fn_x2", None)
    for name in ("F6_E2M3", "F6_E3M2"):
        table[name] = None
    return table


#: safetensors dtype name -> torch dtype (None: this torch has no equivalent; loading such a
#: tensor raises InvalidFileError naming it).
DTYPES: Dict[str, Optional[torch.dtype]] = _build_dtypes()


def _error(cls, message: str, *, file: Optional[str] = None, tensor: Optional[str] = None):
    """An instance of a pinload error class, formatted and filled in as the C++ core does."""
    text = (f"{file}: " if file else "") + (f"tensor '{tensor}': " if tensor else "") + message
    e = cls(text)
    e.file, e.tensor, e.message = file, tensor, message
    return e


def _torch_dtype(dtype: str, tensor: str, file: Optional[str]) -> torch.dtype:
    if dtype not in DTYPES:
        raise _error(InvalidFileError, f"unknown dtype {dtype}", file=file, tensor=tensor)
    torch_dtype = DTYPES[dtype]
    if torch_dtype is None:
        raise _error(
            InvalidFileError,
            f"dtype {dtype} has no equivalent in torch {torch.__version__}; pinload cannot return it as a torch tensor",
            file=file,
            tensor=tensor,
        )
    return torch_dtype


# ---- devices ----

_cuda_state: Optional[Tuple[bool, str]] = None
_warned_fallback = False


def _pinload_cuda() -> Tuple[bool, str]:
    global _cuda_state
    if _cuda_state is None:
        _cuda_state = tuple(_core.cuda_available())  # type: ignore[assignment]
    return _cuda_state  # type: ignore[return-value]


def _other_torch_device(device: Device) -> Optional[torch.device]:
    """A torch device that pinload does not serve itself ('meta', 'mps', 'xpu', ...), or None."""
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        return None
    return None if d.type in ("cpu", "cuda") else d


def _resolve_device(device: Device) -> Tuple[str, Optional[torch.device]]:
    """(pinload device spec, torch device to move to afterwards or None).

    The spec is read by the C++ parser (pinload._devices): 'cpu' loads to host memory, 'sim' to the
    CPU stand-in device (whose memory is host memory), 'cuda[:N]' and ints through pinload's device
    target ('cuda' alone: torch's current device). Any other torch device ('mps', 'xpu', 'meta',
    ...), and CUDA when pinload itself cannot drive it but torch can: a CPU load, then
    ``.to(device)``. Anything else raises InvalidArgumentError naming ``device``.
    """
    global _warned_fallback
    try:
        spec = _devices.parse(device)
    except InvalidArgumentError:
        other = _other_torch_device(device)
        if other is None:
            raise
        return "cpu", other
    if spec.kind != "cuda":
        return spec.name, None
    index = spec.ordinal
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    ok, why = _pinload_cuda()
    if not ok and torch.cuda.is_available():
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"pinload cannot use CUDA ({why}); loading to host memory and copying with torch",
                RuntimeWarning,
                stacklevel=4,
            )
        return "cpu", torch.device("cuda", index)
    return f"cuda:{index}", None


# ---- loads ----


_LoadProgress = _loading.LoadProgress
_wait = _loading.wait
_as_paths = _loading.as_paths


def _start(paths: List[str], spec: str, req: Request, cached_read: str = "auto",
           stream: bool = False, held: Optional["_core.HeldFile"] = None) -> "_core.LoadHandle":
    return _loading.start(paths, spec, req, cached_read=cached_read, stream=stream, held=held)


#: Files up to this size load on the calling thread (_core.load_now): a small file's call then
#: pays no thread start and no hand-off; larger loads run on a thread of their own, so that
#: Ctrl-C and the progress bar get through while they run.
SMALL_FILE_BYTES = 64 << 20


def _small(paths: List[str], req: Request) -> bool:
    if len(paths) != 1 or req.prefetch is not None or req.progress:
        return False
    try:
        st = os.stat(paths[0])
    except OSError:
        return False  # the load names the problem
    return not os.path.isdir(paths[0]) and st.st_size <= SMALL_FILE_BYTES


def _load(paths: List[str], device: Device, req: Request, cached_read: str = "auto",
          held: Optional["_core.HeldFile"] = None) -> Tuple["_core.StateDict", Optional[torch.device]]:
    spec, move_to = _resolve_device(device)
    if held is None and _small(paths, req):
        return _core.load_now([os.fsencode(paths[0])], spec, req.options, cached_read=cached_read), move_to
    return _wait(_start(paths, spec, req, cached_read, held=held), req.progress), move_to


_MAX_TORCH_RANK = 64  # c10's limit on dimensions
_MAX_TORCH_DIM = (1 << 63) - 1  # torch sizes are int64


def _torch_shape(dtype: str, shape: List[int], name: str, file: Optional[str]) -> List[int]:
    """The shape of the torch tensor for a safetensors tensor (F4: the last dimension halved, two
    values a byte), or InvalidFileError naming the tensor where torch cannot hold it."""
    if len(shape) > _MAX_TORCH_RANK:
        raise _error(InvalidFileError, f"rank {len(shape)} exceeds torch's limit of {_MAX_TORCH_RANK} dimensions",
                     file=file, tensor=name)
    if shape and max(shape) > _MAX_TORCH_DIM:
        raise _error(InvalidFileError, f"shape {shape} has a dimension beyond torch's int64 sizes",
                     file=file, tensor=name)
    if dtype == "F4":
        if not shape or shape[-1] % 2 != 0:
            raise _error(InvalidFileError,
                         f"F4 as torch.float4_e2m1fn_x2 packs 2 values a byte: the last dimension must be even, "
                         f"got shape {shape}", file=file, tensor=name)
        return shape[:-1] + [shape[-1] // 2]
    return shape


def _check_dtypes(sd: "_core.StateDict", file: Optional[str]) -> List[Tuple[torch.dtype, List[int]]]:
    """Every tensor's torch dtype and shape, in load order: a tensor torch cannot hold fails the
    call before any tensor is handed out."""
    return [(_torch_dtype(dtype, name, file), _torch_shape(dtype, shape, name, file))
            for name, dtype, shape in sd.infos()]


def _to_torch(dtype: str, shape: List[int], export: Any, torch_device: str, move_to: Optional[torch.device],
              name: str, file: Optional[str]) -> torch.Tensor:
    return _as_torch(_torch_dtype(dtype, name, file), _torch_shape(dtype, shape, name, file), dtype, export,
                     torch_device, move_to, name, file)


def _as_torch(torch_dtype: torch.dtype, shape: List[int], dtype: str, export: Any, torch_device: str,
              move_to: Optional[torch.device], name: str, file: Optional[str]) -> torch.Tensor:
    """The tensor of `export`, whose torch dtype and shape _check_dtypes gave."""
    try:
        if export is None:  # no bytes (a zero-size tensor): nothing to alias
            tensor = torch.empty(shape, dtype=torch_dtype, device=torch_device)
        else:
            # Typed and shaped already, but for the types DLPack spells as bytes (Note [DLPack export]).
            # Host memory needs no stream hand-shake: the capsule itself, which spares torch's
            # negotiation with the producer (a small file's call pays it for every tensor).
            tensor = torch.from_dlpack(export.__dlpack__() if torch_device == "cpu" else export)
            if tensor.dtype != torch_dtype:
                tensor = tensor.view(torch_dtype)
            if list(tensor.shape) != list(shape):
                tensor = tensor.reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise _error(InvalidFileError, f"torch cannot hold a {dtype} tensor of shape {shape}: {str(e).splitlines()[0]}",
                     file=file, tensor=name) from None
    if move_to is not None:
        tensor = tensor.to(move_to)
    return tensor


def _describe(paths: List[str]) -> str:
    return paths[0] if len(paths) == 1 else ", ".join(paths)


def _yield_all(sd: "_core.StateDict", move_to: Optional[torch.device],
               file: str) -> Iterator[Tuple[str, torch.Tensor]]:
    resolved = _check_dtypes(sd, file)
    return _yield_entries(collections.deque(sd.export_all()), resolved, sd.torch_device, move_to, file)


def _yield_entries(entries: "collections.deque", resolved: List[Tuple[torch.dtype, List[int]]], torch_device: str,
                   move_to: Optional[torch.device], file: str) -> Iterator[Tuple[str, torch.Tensor]]:
    # One export per tensor, dropped as soon as it is converted (the state dict that exported
    # them is gone): a file's block goes back to the pool once the caller has dropped every tensor
    # of that file. `resolved`: _check_dtypes' answer for the same tensors, in the same order.
    for torch_dtype, shape in resolved:
        name, dtype, _, export = entries.popleft()
        tensor = _as_torch(torch_dtype, shape, dtype, export, torch_device, move_to, name, file)
        del export
        yield name, tensor


def _iterate(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    sd, move_to = _load(paths, device, req)
    return _yield_all(sd, move_to, _describe(paths))


def _stream(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields tensors as the load hands them out (Note [Ready tensors] in loader.h); stopping early,
    or an error, cancels the load."""
    spec, move_to = _resolve_device(device)
    # HandOut::kStream: the load keeps none of the tensors it hands out (loader.h).
    handle = _start(paths, spec, req, stream=True)
    shown = _LoadProgress(handle, req.progress)
    file = _describe(paths)
    try:
        while True:
            batch = handle.next_ready(shown.poll)
            if batch is None:
                break
            shown.tick()
            resolved = _check_dtypes(batch, file)
            entries, torch_device = collections.deque(batch.export_all()), batch.torch_device
            del batch  # the exports alone hold the tensors now
            yield from _yield_entries(entries, resolved, torch_device, move_to, file)
    except BaseException:
        handle.cancel()
        handle.wait(None)
        raise
    shown.finish()


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
        sd, move_to = _load([path], device, request(progress=progress, prefetch=prefetch, options=options,
                                                    **load_options), cached_read)
    except NotFoundError as e:
        raise _compat.missing_file(e, path) from None
    return dict(_yield_all(sd, move_to, path))


def load(data: bytes, **options: Any) -> Dict[str, torch.Tensor]:
    """Loads a safetensors file from its bytes: a drop-in for ``safetensors.torch.load``.

    The bytes go through pinload's reader and parser like a file's (written to a temporary file
    first, removed before this returns); the tensors do not alias ``data``.
    """
    from .numpy import _load_bytes

    return _load_bytes(data, load_file, **options)


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
    return dict(_iterate(_as_paths(index_or_paths), device, req))


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
    names = _as_paths(paths)
    seen: set = set()
    for p in names:
        if p in seen:
            raise ValueError(f"path given twice: {p!r}")
        seen.add(p)
    req = request(options=options, **load_options)
    if req.options.dtype is not None:
        raise TypeError("load_files_batch takes no dtype/keep/keep_dtype options")
    cached_read = _compat.cached_read_of(backend)
    spec, move_to = _resolve_device(device)
    entries = _core.load_batch([os.fsencode(p) for p in names], spec, req.options, cached_read=cached_read)
    out: Dict[str, Any] = {}
    failed: Dict[str, BaseException] = {}
    entry: Any
    for p, entry in zip(names, entries):
        if not isinstance(entry, BaseException):
            try:
                entry = dict(_yield_all(entry, move_to, p))
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
    return _stream(_as_paths(paths), device, req)


# ---- safe_open ----


class _Slice:
    """What ``safe_open.get_slice`` returns: shape and dtype without a load; indexing loads the file
    (once) and returns the indexed part as a contiguous tensor (torch's indexing, as the reference
    does for "pt") or array (the reference's own rules for "np": an index past a dimension's end is
    an error; see _safetensors_compat)."""

    __slots__ = ("_file", "_name")

    def __init__(self, file: "safe_open", name: str) -> None:
        self._file = file
        self._name = name

    def get_shape(self) -> List[int]:
        return self._file.get_shape(self._name)

    def get_dtype(self) -> str:
        return self._file.get_dtype(self._name)

    def __getitem__(self, index) -> Any:
        whole = self._file.get_tensor(self._name)
        if self._file._numpy:
            import numpy as np

            return np.ascontiguousarray(whole[_compat.reference_index(index, self.get_shape())])
        return whole[index].contiguous()  # torch's indexing, as the reference's "pt" slices

    def __repr__(self) -> str:
        return f"<pinload slice {self._name!r} {self.get_dtype()} {self.get_shape()}>"


class safe_open:
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
        self._path = _compat.filename_of(filename)
        self._closed = True  # until the header is read
        if framework in ("np", "numpy"):
            self._numpy = True
            if device not in ("cpu", None) and str(device) != "cpu":
                raise _error(InvalidFileError, f"numpy arrays live in host memory; device must be 'cpu', not {device!r}",
                             file=self._path)
        elif framework in ("pt", "torch", "pytorch"):
            self._numpy = False
        else:
            raise _error(InvalidFileError,
                         f"framework {framework!r} is not supported: pinload returns torch tensors (framework='pt') "
                         "or numpy arrays (framework='np')",
                         file=self._path)
        self._cached_read = _compat.cached_read_of(backend)
        self._device = device
        self._request = request(progress=progress, prefetch=prefetch, options=options, **load_options)
        spec, _ = _resolve_device(device)
        if spec != "cpu":
            _core.pool_stats(spec)  # opens the device now: an unusable one fails here, not at get_tensor
        # Held open until close(): get_tensor reads the file whose header this is, even after the path
        # is replaced (Note [Holding a file] in include/pinload/env.h), as the reference does. A
        # remote object (s3://, http(s)://; docs/remote.md) cannot be held: its header is read now and
        # the load checks that the object it reads still has that header.
        self._held: Optional[_core.HeldFile] = None
        try:
            if self._path.startswith(_compat.REMOTE_PREFIXES):
                header = _core.read_header(os.fsencode(self._path))
            else:
                self._held = _core.HeldFile(os.fsencode(self._path))
                header = self._held.header()
        except NotFoundError as e:
            raise _compat.missing_file(e, self._path) from None
        self._offset_order: List[str] = [t[0] for t in header["tensors"]]
        self._info: Dict[str, Tuple[str, List[int]]] = {t[0]: (t[1], t[2]) for t in header["tensors"]}
        self._metadata: Optional[Dict[str, str]] = header["metadata"]
        self._lock = threading.Lock()
        self._sd: Optional[_core.StateDict] = None
        self._move_to: Optional[torch.device] = None
        self._closed = False

    # context manager
    def __enter__(self) -> "safe_open":
        self._check_open()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drops this handle's reference to the loaded file; tensors handed out stay valid."""
        with self._lock:
            self._closed = True
            self._sd = None
            self._held = None

    def _check_open(self) -> None:
        if self._closed:
            raise _compat.closed(self._path)

    def _info_of(self, name: str) -> Tuple[str, List[int]]:
        self._check_open()
        info = self._info.get(name)
        if info is None:
            raise _compat.missing_tensor(self._path, name)
        return info

    def _state_dict(self) -> "_core.StateDict":
        with self._lock:
            self._check_open()
            if self._sd is None:
                sd, move_to = _load([self._path], self._device, self._request, self._cached_read, self._held)
                # Names and shapes (a dtype= load converts the dtypes).
                if self._held is None and ({n: list(s) for n, _, s in sd.infos()} !=
                                           {n: list(s) for n, (_, s) in self._info.items()}):
                    raise _error(IoError, "the object changed since safe_open read its header: reopen it",
                                 file=self._path)
                self._sd, self._move_to = sd, move_to
                self._loaded()
            return self._sd

    def _loaded(self) -> None:
        """Called once, under the handle's lock, after the file has been loaded (a hook for
        subclasses: pinload.hooks counts loads with it)."""

    # safetensors' API
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

    def _check_dtype(self, dtype: str, name: str) -> None:
        if self._numpy:
            from .numpy import numpy_dtype

            numpy_dtype(dtype, name, self._path)
        else:
            _torch_dtype(dtype, name, self._path)

    def get_tensor(self, name: str) -> Any:
        """The tensor (framework "pt") or array (framework "np") ``name``."""
        dtype, shape = self._info_of(name)
        self._check_dtype(dtype, name)
        _torch_shape(dtype, shape, name, self._path)
        sd = self._state_dict()
        _, dtype, shape, export = sd.export(name)
        if self._numpy:
            from .numpy import to_numpy

            return to_numpy(dtype, shape, export, name, self._path)
        return _to_torch(dtype, shape, export, sd.torch_device, self._move_to, name, self._path)

    def get_tensors(self) -> Dict[str, Any]:
        """Every tensor, in file order."""
        self._check_open()
        for name in self._offset_order:
            self._check_dtype(self._info[name][0], name)
            _torch_shape(self._info[name][0], self._info[name][1], name, self._path)
        return {name: self.get_tensor(name) for name in self._offset_order}

    def get_slice(self, name: str) -> _Slice:
        self._info_of(name)
        return _Slice(self, name)

    # pinload extras
    def get_shape(self, name: str) -> List[int]:
        return list(self._info_of(name)[1])

    def get_dtype(self, name: str) -> str:
        """The safetensors dtype name ("BF16", "F8_E4M3", ...)."""
        return self._info_of(name)[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("loaded" if self._sd is not None else "open")
        return f"<pinload.safe_open {self._path!r} {len(self._info)} tensors, {state}>"


# safe_open over an open file object (safetensors' _safe_open_handle): Note [Handles] there.
from ._file_handle import safe_open_handle  # noqa: E402


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
