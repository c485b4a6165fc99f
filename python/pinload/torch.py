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
- ``direct`` ("auto" | "on" | "off"): O_DIRECT reads (auto: unless the file is already cached);
- ``files_in_flight`` (2): shards read at once; ``variant``: "fp16" loads ``*.fp16.safetensors``;
- ``streams`` (2), ``chunk_bytes`` (8 MiB): host-to-device copy streams and chunk size;
- ``staging_bytes``: streaming mode for device loads (host memory capped at this many bytes);
- or all of these as one ``options=pinload.LoadOptions(...)`` (typed: :class:`pinload.LoadKwargs`);
- ``progress`` (False): a progress bar on stderr when the load takes over a second on a terminal;
- ``prefetch``: a ``pinload.prefetch(...)`` handle of the same paths and device, adopted: what it
  has read is not read again (the prefetch's own options then apply).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _core, _devices
from ._core import Error, InvalidArgumentError, InvalidFileError, NotFoundError
from ._options import LoadKwargs, LoadOptions, Request, request

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DTYPES", "iter_tensors", "load_file", "load_files", "safe_open"]

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
    # Sub-byte types: torch has no unpacked equivalent.
    for name in ("F4", "F6_E2M3", "F6_E3M2"):
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


class _ProgressBar:
    """``[#####.....] 1.23/4.56 GB 2.34 GB/s`` on stderr, redrawn at most 10 times a second."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.last_draw = 0.0
        self.drawn = False

    def draw(self, done: int, total: int, seconds: float, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        width = 30
        filled = width if total == 0 else min(width, int(width * done / total))
        rate = done / 1e9 / seconds if seconds > 0 else 0.0
        self.stream.write(
            f"\rpinload [{'#' * filled}{'.' * (width - filled)}] {done / 1e9:.2f}/{total / 1e9:.2f} GB {rate:.2f} GB/s"
        )
        self.stream.flush()
        self.drawn = True

    def finish(self, done: int, total: int, seconds: float) -> None:
        if self.drawn:
            self.draw(done, total, seconds, force=True)
            self.stream.write("\n")
            self.stream.flush()


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _LoadProgress:
    """Draws a load's progress bar on stderr once it has run for a second (only on a terminal)."""

    def __init__(self, handle: "_core.LoadHandle", progress: bool) -> None:
        self.handle = handle
        self.bar = _ProgressBar(sys.stderr) if progress and _stderr_is_terminal() else None
        self.start = time.monotonic()
        self.poll = 0.05 if self.bar is not None else 0.2  # short waits: signals get through between them

    def tick(self) -> None:
        if self.bar is not None and time.monotonic() - self.start >= 1.0:
            p = self.handle.progress()
            self.bar.draw(p["bytes_done"], p["bytes_total"], time.monotonic() - self.start)

    def finish(self) -> None:
        if self.bar is not None:
            p = self.handle.progress()
            self.bar.finish(p["bytes_done"], p["bytes_total"], time.monotonic() - self.start)


def _wait(handle: "_core.LoadHandle", progress: bool) -> "_core.StateDict":
    """Waits for a load (Ctrl-C cancels it) and returns its state dict."""
    shown = _LoadProgress(handle, progress)
    try:
        while not handle.wait(shown.poll):
            shown.tick()
    except BaseException:
        handle.cancel()
        handle.wait(None)
        raise
    shown.finish()
    return handle.result()


def _as_paths(paths: Union[PathLike, Iterable[PathLike]]) -> List[str]:
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    out = [os.fsdecode(os.fspath(p)) for p in paths]
    if not out:
        raise ValueError("no path given")
    return out


def _start(paths: List[str], spec: str, req: Request) -> "_core.LoadHandle":
    return _core.load_async([os.fsencode(p) for p in paths], spec, req.options, req.prefetch)


def _load(paths: List[str], device: Device, req: Request) -> Tuple["_core.StateDict", Optional[torch.device]]:
    spec, move_to = _resolve_device(device)
    return _wait(_start(paths, spec, req), req.progress), move_to


def _check_dtypes(sd: "_core.StateDict", file: Optional[str]) -> None:
    for name, dtype, _shape in sd.infos():
        _torch_dtype(dtype, name, file)


def _to_torch(dtype: str, shape: List[int], export: Any, torch_device: str, move_to: Optional[torch.device],
              name: str, file: Optional[str]) -> torch.Tensor:
    torch_dtype = _torch_dtype(dtype, name, file)
    if export is None:  # no bytes (a zero-size tensor): nothing to alias
        tensor = torch.empty(shape, dtype=torch_dtype, device=torch_device)
    else:
        # Typed and shaped already, but for the types DLPack spells as bytes (Note [DLPack export]).
        tensor = torch.from_dlpack(export)
        if tensor.dtype != torch_dtype:
            tensor = tensor.view(torch_dtype)
        if list(tensor.shape) != list(shape):
            tensor = tensor.reshape(shape)
    if move_to is not None:
        tensor = tensor.to(move_to)
    return tensor


def _describe(paths: List[str]) -> str:
    return paths[0] if len(paths) == 1 else ", ".join(paths)


def _yield_all(sd: "_core.StateDict", move_to: Optional[torch.device],
               file: str) -> Iterator[Tuple[str, torch.Tensor]]:
    _check_dtypes(sd, file)
    torch_device = sd.torch_device
    # One export per tensor, dropped as soon as it is converted: a file's block goes back to the
    # pool once the caller has dropped every tensor of that file.
    entries = collections.deque(sd.export_all())
    del sd
    while entries:
        name, dtype, shape, export = entries.popleft()
        tensor = _to_torch(dtype, shape, export, torch_device, move_to, name, file)
        del export
        yield name, tensor


def _iterate(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    sd, move_to = _load(paths, device, req)
    return _yield_all(sd, move_to, _describe(paths))


def _stream(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields tensors as the load hands them out (Note [Ready tensors] in loader.h); stopping early,
    or an error, cancels the load."""
    spec, move_to = _resolve_device(device)
    handle = _start(paths, spec, req)
    shown = _LoadProgress(handle, req.progress)
    file = _describe(paths)
    try:
        while True:
            batch = handle.next_ready(shown.poll)
            if batch is None:
                break
            shown.tick()
            yield from _yield_all(batch, move_to, file)
    except BaseException:
        handle.cancel()
        handle.wait(None)
        raise
    shown.finish()


def load_file(filename: PathLike, device: Device = "cpu", *, progress: bool = False,
              prefetch: Optional["_core.Prefetch"] = None, options: Optional[LoadOptions] = None,
              **load_options: "Unpack[LoadKwargs]") -> Dict[str, torch.Tensor]:
    """Loads a safetensors file: a drop-in for ``safetensors.torch.load_file``.

    ``device``: "cpu" (the default), "cuda", "cuda:N", an int or a torch.device; "sim" (pinload's
    CPU stand-in device, for tests). Device loads go through pinload's pipelined device target
    (cached mode; streaming mode with ``staging_bytes``). Returns name -> tensor in file order.
    Options: see the module docstring. Raises pinload.Error subclasses.
    """
    req = request(progress=progress, prefetch=prefetch, options=options, **load_options)
    return dict(_iterate(_as_paths(filename), device, req))


def load_files(index_or_paths: Union[PathLike, Sequence[PathLike]], device: Device = "cpu", *,
               progress: bool = False, prefetch: Optional["_core.Prefetch"] = None,
               options: Optional[LoadOptions] = None, **load_options: "Unpack[LoadKwargs]") -> Dict[str, torch.Tensor]:
    """Loads a sharded checkpoint: files, ``*.safetensors.index.json`` indexes, model folders or
    diffusers pipeline folders (whose tensors are named ``component/name``), in one parallel load.

    Returns name -> tensor in load order. Options: see the module docstring.
    """
    req = request(progress=progress, prefetch=prefetch, options=options, **load_options)
    return dict(_iterate(_as_paths(index_or_paths), device, req))


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
    (once) and returns the indexed part as a contiguous tensor."""

    __slots__ = ("_file", "_name")

    def __init__(self, file: "safe_open", name: str) -> None:
        self._file = file
        self._name = name

    def get_shape(self) -> List[int]:
        return self._file.get_shape(self._name)

    def get_dtype(self) -> str:
        return self._file.get_dtype(self._name)

    def __getitem__(self, index) -> torch.Tensor:
        return self._file.get_tensor(self._name)[index].contiguous()

    def __repr__(self) -> str:
        return f"<pinload slice {self._name!r} {self.get_dtype()} {self.get_shape()}>"


class safe_open:
    """Opens a safetensors file: a drop-in for ``safetensors.safe_open(filename, framework="pt")``.

    The header is read and checked at once (a missing file raises NotFoundError, a bad one
    InvalidFileError). The first ``get_tensor``/``get_tensors`` (or slice indexing) loads the whole
    file in one parallel sweep into the device's shared pool; later calls alias that load. Tensors
    stay valid after the handle is closed. Usable as a context manager; thread-safe.

    ``device``: as ``load_file``. ``backend`` is accepted for compatibility with safetensors and
    ignored. Other keyword arguments are load options (see the module docstring).
    """

    def __init__(self, filename: PathLike, framework: str = "pt", device: Device = "cpu", *,
                 backend: Optional[str] = None, progress: bool = False,
                 prefetch: Optional["_core.Prefetch"] = None, options: Optional[LoadOptions] = None,
                 **load_options: "Unpack[LoadKwargs]") -> None:
        self._path = os.fsdecode(os.fspath(filename))
        if framework not in ("pt", "torch", "pytorch"):
            raise _error(InvalidFileError,
                         f"framework {framework!r} is not supported: pinload returns torch tensors (framework='pt')",
                         file=self._path)
        self._device = device
        self._request = request(progress=progress, prefetch=prefetch, options=options, **load_options)
        spec, _ = _resolve_device(device)
        if spec != "cpu":
            _core.pool_stats(spec)  # opens the device now: an unusable one fails here, not at get_tensor
        header = _core.read_header(os.fsencode(self._path))
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

    def _check_open(self) -> None:
        if self._closed:
            raise _error(Error, "file is closed", file=self._path)

    def _info_of(self, name: str) -> Tuple[str, List[int]]:
        self._check_open()
        info = self._info.get(name)
        if info is None:
            raise _error(NotFoundError, "no such tensor in the file", file=self._path, tensor=name)
        return info

    def _state_dict(self) -> "_core.StateDict":
        with self._lock:
            self._check_open()
            if self._sd is None:
                self._sd, self._move_to = _load([self._path], self._device, self._request)
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

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape = self._info_of(name)
        _torch_dtype(dtype, name, self._path)
        sd = self._state_dict()
        _, dtype, shape, export = sd.export(name)
        return _to_torch(dtype, shape, export, sd.torch_device, self._move_to, name, self._path)

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor, in file order."""
        self._check_open()
        for name in self._offset_order:
            _torch_dtype(self._info[name][0], name, self._path)
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
