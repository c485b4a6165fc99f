"""Torch tensors from pinload loads: what pinload.torch, its ``safe_open``, pinload.cache and the file
handles share (dtypes, devices, starting and waiting for loads, DLPack exports as torch tensors).

Internal: its names are public to the package's modules, not to users (pinload.torch re-exports
DTYPES). Imports torch, pinload's core and pinload._loading, and no other module of the package.
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from . import _core, _devices, _loading
from ._core import InvalidArgumentError, InvalidFileError
from ._options import Request

PathLike = Union[str, "os.PathLike[str]", bytes]
Device = Union[str, int, "torch.device", None]

# ---- dtypes ----


def build_dtypes() -> Dict[str, Optional[torch.dtype]]:
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
    # F4 as torch packs it, two to a byte: the last dimension is halved (torch_shape), as the
    # reference does. F6 has no torch equivalent (the reference refuses it too).
    table["F4"] = getattr(torch, "float4_e2m1fn_x2", None)
    for name in ("F6_E2M3", "F6_E3M2"):
        table[name] = None
    return table


#: safetensors dtype name -> torch dtype (None: this torch has no equivalent; loading such a
#: tensor raises InvalidFileError naming it).
DTYPES: Dict[str, Optional[torch.dtype]] = build_dtypes()


def error(cls, message: str, *, file: Optional[str] = None, tensor: Optional[str] = None):
    """An instance of a pinload error class, formatted and filled in as the C++ core does."""
    text = (f"{file}: " if file else "") + (f"tensor '{tensor}': " if tensor else "") + message
    e = cls(text)
    e.file, e.tensor, e.message = file, tensor, message
    return e


def torch_dtype(dtype: str, tensor: str, file: Optional[str]) -> torch.dtype:
    if dtype not in DTYPES:
        raise error(InvalidFileError, f"unknown dtype {dtype}", file=file, tensor=tensor)
    torch_dtype = DTYPES[dtype]
    if torch_dtype is None:
        raise error(
            InvalidFileError,
            f"dtype {dtype} has no equivalent in torch {torch.__version__}; pinload cannot return it as a torch tensor",
            file=file,
            tensor=tensor,
        )
    return torch_dtype


# ---- devices ----

_cuda_state: Optional[Tuple[bool, str]] = None
_warned_fallback = False


def pinload_cuda() -> Tuple[bool, str]:
    global _cuda_state
    if _cuda_state is None:
        _cuda_state = tuple(_core.cuda_available())  # type: ignore[assignment]
    return _cuda_state  # type: ignore[return-value]


def other_torch_device(device: Device) -> Optional[torch.device]:
    """A torch device that pinload does not serve itself ('meta', 'mps', 'xpu', ...), or None."""
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        return None
    return None if d.type in ("cpu", "cuda") else d


def resolve_device(device: Device) -> Tuple[str, Optional[torch.device]]:
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
        other = other_torch_device(device)
        if other is None:
            raise
        return "cpu", other
    if spec.kind != "cuda":
        return spec.name, None
    index = spec.ordinal
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    ok, why = pinload_cuda()
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


def start(paths: List[str], spec: str, req: Request, cached_read: str = "auto",
           stream: bool = False, held: Optional["_core.HeldFile"] = None) -> "_core.LoadHandle":
    return _loading.start(paths, spec, req, cached_read=cached_read, stream=stream, held=held)


#: Files up to this size load on the calling thread (_core.load_now): a small file's call then
#: pays no thread start and no hand-off; larger loads run on a thread of their own, so that
#: Ctrl-C and the progress bar get through while they run.
SMALL_FILE_BYTES = 64 << 20


def is_small(paths: List[str], req: Request) -> bool:
    if len(paths) != 1 or req.prefetch is not None or req.progress:
        return False
    try:
        st = os.stat(paths[0])
    except OSError:
        return False  # the load names the problem
    return not os.path.isdir(paths[0]) and st.st_size <= SMALL_FILE_BYTES


def load_paths(paths: List[str], device: Device, req: Request, cached_read: str = "auto",
          held: Optional["_core.HeldFile"] = None) -> Tuple["_core.StateDict", Optional[torch.device]]:
    spec, move_to = resolve_device(device)
    if held is None and is_small(paths, req):
        return _core.load_now([os.fsencode(paths[0])], spec, req.options, cached_read=cached_read), move_to
    return _loading.wait(start(paths, spec, req, cached_read, held=held), req.progress), move_to


_MAX_TORCH_RANK = 64  # c10's limit on dimensions
_MAX_TORCH_DIM = (1 << 63) - 1  # torch sizes are int64


def torch_shape(dtype: str, shape: List[int], name: str, file: Optional[str]) -> List[int]:
    """The shape of the torch tensor for a safetensors tensor (F4: the last dimension halved, two
    values a byte), or InvalidFileError naming the tensor where torch cannot hold it."""
    if len(shape) > _MAX_TORCH_RANK:
        raise error(InvalidFileError, f"rank {len(shape)} exceeds torch's limit of {_MAX_TORCH_RANK} dimensions",
                     file=file, tensor=name)
    if shape and max(shape) > _MAX_TORCH_DIM:
        raise error(InvalidFileError, f"shape {shape} has a dimension beyond torch's int64 sizes",
                     file=file, tensor=name)
    if dtype == "F4":
        if not shape or shape[-1] % 2 != 0:
            raise error(InvalidFileError,
                         f"F4 as torch.float4_e2m1fn_x2 packs 2 values a byte: the last dimension must be even, "
                         f"got shape {shape}", file=file, tensor=name)
        return shape[:-1] + [shape[-1] // 2]
    return shape


def check_dtypes(sd: "_core.StateDict", file: Optional[str]) -> List[Tuple[torch.dtype, List[int]]]:
    """Every tensor's torch dtype and shape, in load order: a tensor torch cannot hold fails the
    call before any tensor is handed out."""
    return [(torch_dtype(dtype, name, file), torch_shape(dtype, shape, name, file))
            for name, dtype, shape in sd.infos()]


def to_torch(dtype: str, shape: List[int], export: Any, torch_device: str, move_to: Optional[torch.device],
              name: str, file: Optional[str]) -> torch.Tensor:
    return as_torch(torch_dtype(dtype, name, file), torch_shape(dtype, shape, name, file), dtype, export,
                     torch_device, move_to, name, file)


def as_torch(torch_dtype: torch.dtype, shape: List[int], dtype: str, export: Any, torch_device: str,
              move_to: Optional[torch.device], name: str, file: Optional[str]) -> torch.Tensor:
    """The tensor of `export`, whose torch dtype and shape check_dtypes gave."""
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
        raise error(InvalidFileError, f"torch cannot hold a {dtype} tensor of shape {shape}: {str(e).splitlines()[0]}",
                     file=file, tensor=name) from None
    if move_to is not None:
        tensor = tensor.to(move_to)
    return tensor


def describe(paths: List[str]) -> str:
    return paths[0] if len(paths) == 1 else ", ".join(paths)


def yield_all(sd: "_core.StateDict", move_to: Optional[torch.device],
               file: str) -> Iterator[Tuple[str, torch.Tensor]]:
    resolved = check_dtypes(sd, file)
    return yield_entries(collections.deque(sd.export_all()), resolved, sd.torch_device, move_to, file)


def yield_entries(entries: "collections.deque", resolved: List[Tuple[torch.dtype, List[int]]], torch_device: str,
                   move_to: Optional[torch.device], file: str) -> Iterator[Tuple[str, torch.Tensor]]:
    # One export per tensor, dropped as soon as it is converted (the state dict that exported
    # them is gone): a file's block goes back to the pool once the caller has dropped every tensor
    # of that file. `resolved`: check_dtypes' answer for the same tensors, in the same order.
    for torch_dtype, shape in resolved:
        name, dtype, _, export = entries.popleft()
        tensor = as_torch(torch_dtype, shape, dtype, export, torch_device, move_to, name, file)
        del export
        yield name, tensor


def iterate(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    sd, move_to = load_paths(paths, device, req)
    return yield_all(sd, move_to, describe(paths))


def stream_tensors(paths: List[str], device: Device, req: Request) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields tensors as the load hands them out (Note [Ready tensors] in loader.h); stopping early,
    or an error, cancels the load."""
    spec, move_to = resolve_device(device)
    # HandOut::kStream: the load keeps none of the tensors it hands out (loader.h).
    handle = start(paths, spec, req, stream=True)
    shown = _loading.LoadProgress(handle, req.progress)
    file = describe(paths)
    try:
        while True:
            batch = handle.next_ready(shown.poll)
            if batch is None:
                break
            shown.tick()
            resolved = check_dtypes(batch, file)
            entries, torch_device = collections.deque(batch.export_all()), batch.torch_device
            del batch  # the exports alone hold the tensors now
            yield from yield_entries(entries, resolved, torch_device, move_to, file)
    except BaseException:
        handle.cancel()
        handle.wait(None)
        raise
    shown.finish()
