"""pinload: load safetensors checkpoints fast, into a reusable pinned memory pool, zero-copy into PyTorch.

The safetensors-compatible API (``safe_open``, ``pinload.torch.load_file``) and the sharded loaders
(``load_files``, ``iter_tensors``) live in :mod:`pinload.torch` and are re-exported here, as is
:class:`ModelCache` (:mod:`pinload.cache`, docs/cache.md); they import torch on first use, so
``import pinload`` alone stays light. See docs/python.md.

Load options are :class:`LoadOptions` (the C++ core's, checked there once), or the same as keyword
arguments of every load (typed by :class:`LoadKwargs`).

Every error pinload raises is a :class:`pinload.Error`:

- :class:`InvalidArgumentError` (also a ``ValueError``): a caller's mistake (an option out of range,
  an unknown device), naming the argument;
- :class:`InvalidFileError` (also a ``ValueError``): a malformed file or index;
- :class:`NotFoundError` (also a ``FileNotFoundError``): a path or tensor that does not exist;
- :class:`IoError` (also an ``OSError``): the OS failed a read, open or stat;
- :class:`OutOfMemoryError` (also a ``MemoryError``): the OS or the pool's budget refused memory;
- :class:`DeviceError`: the accelerator failed or is unavailable;
- :class:`CancelledError`: the load was cancelled (Ctrl-C);
- :class:`IntegrityError`: bytes that differ from a manifest's digests or a file's published sha256
  (``verify=``, docs/manifest.md); nothing of that load is returned.
- :class:`UnavailableError` (also a ``ConnectionError``): the node store could not be reached by a load
  that requires it (``store_required=True``, docs/store.md).

Each carries ``.file``, ``.tensor``, ``.begin``, ``.end`` (None where they do not apply), ``.code``
and ``.message``.
"""

from __future__ import annotations

import pkgutil
from typing import TYPE_CHECKING, Any, Optional

# A build tree keeps the compiled module in <build>/python/pinload/ and the sources in python/pinload/:
# with both on sys.path, this package spans the two folders.
__path__ = pkgutil.extend_path(__path__, __name__)

from . import _core, _devices  # noqa: E402
from ._core import (  # noqa: E402
    CancelledError,
    DeviceError,
    Error,
    IntegrityError,
    UnavailableError,
    InvalidArgumentError,
    InvalidFileError,
    IoError,
    LoadOptions,
    NotFoundError,
    OutOfMemoryError,
)
from ._options import LoadKwargs, request  # noqa: E402

if TYPE_CHECKING:
    from typing_extensions import Unpack

__version__ = _core.__version__
#: The pinned staging budget of a streaming device load given no ``staging_bytes``.
DEFAULT_STAGING_BYTES: int = _core.DEFAULT_STAGING_BYTES

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "CancelledError",
    "DeviceError",
    "Error",
    "IntegrityError",
    "UnavailableError",
    "InvalidArgumentError",
    "InvalidFileError",
    "IoError",
    "LoadKwargs",
    "LoadOptions",
    "ModelCache",
    "NotFoundError",
    "OutOfMemoryError",
    "convert",
    "cuda_available",
    "store_status",
    "deserialize",
    "iter_tensors",
    "load_file",
    "load_files",
    "load_files_batch",
    "patch_diffusers",
    "patch_transformers",
    "pool_stats",
    "prefetch",
    "safe_open",
    "serialize",
    "serialize_file",
    "trim_pool",
    "write_manifest",
]

# Names served by submodules that import torch (or diffusers / transformers) on first use.
_LAZY = {
    "safe_open": "torch",
    "load_file": "torch",
    "load_files": "torch",
    "load_files_batch": "torch",
    "iter_tensors": "torch",
    "patch_diffusers": "hooks",
    "patch_transformers": "hooks",
    "ModelCache": "cache",
    # safetensors' top-level API (no torch needed)
    "serialize": "_safetensors_compat",
    "serialize_file": "_safetensors_compat",
    "deserialize": "_safetensors_compat",
}


_SUBMODULES: "tuple[str, ...]" = ("torch", "numpy", "skip_init", "hooks", "cache")

if TYPE_CHECKING:
    # What type checkers see: the lazy names above, with their real signatures (at run time they
    # are imported on first use, by __getattr__ below).
    from . import cache, hooks, numpy, skip_init, torch  # noqa: F401
    from .cache import ModelCache
    from .hooks import patch_diffusers, patch_transformers
    from ._safetensors_compat import deserialize, serialize, serialize_file
    from .torch import iter_tensors, load_file, load_files, load_files_batch, safe_open


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:  # pinload.skip_init.empty_model(...) after a plain `import pinload`
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:  # TensorSpec, SafetensorError: the reference's own, where it has them
        from ._safetensors_compat import reference_object

        return reference_object(__name__, name)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def pool_stats(device="cpu", pool_bytes=None, staging_bytes=None) -> dict:
    """Statistics of the pool that loads to ``device`` share ('cpu', 'sim', 'cuda:N'); with
    ``pool_bytes``, of the pool that the loads given that ``pool_bytes=`` share; with
    ``staging_bytes`` (a device only), of the pinned staging pool that the streaming loads of that
    budget share (``DEFAULT_STAGING_BYTES`` for loads given none).

    Keys (bytes unless noted): ``reserved`` (held from the OS), ``in_use`` (in live blocks),
    ``peak``, ``peak_reserved``, ``capacity`` (0: unlimited), ``collapsed`` (idle memory first
    touched in 4 KiB pages, since collapsed into huge pages: docs/tuning.md), and counts ``allocations``,
    ``free_list_hits`` (allocations that reused a block), ``os_reservations``, ``os_releases``,
    ``budget_waits``, ``live_blocks``; ``backend`` names the memory backend.
    """
    from ._options import size

    return _core.pool_stats(_devices.key(device), None if pool_bytes is None else size(pool_bytes, "pool_bytes"),
                            None if staging_bytes is None else size(staging_bytes, "staging_bytes"))


def trim_pool(device="cpu") -> None:
    """Returns the idle memory of ``device``'s pool to the OS (blocks in use stay)."""
    _core.trim_pool(_devices.key(device))


def prefetch(paths: Any, device: Any = "cpu", *, options: Optional[LoadOptions] = None,
             **load_options: "Unpack[LoadKwargs]") -> "_core.Prefetch":
    """Starts reading ``paths`` (files, indexes, folders, as ``load_files`` takes them) in the
    background and returns at once, before torch or the framework is even imported.

    A later ``pinload.torch.load_file``/``load_files``/``iter_tensors`` of the same paths and device
    with ``prefetch=handle`` adopts it: what was read is not read again, and blocks are handed over.
    The handle has ``done()``, ``wait(timeout)``, ``cancel()`` (stops promptly; what was read stays
    adoptable), ``progress()`` and ``adopted``. Dropping it stops it and frees its memory. Options as
    for the loads (``threads``, ``block_size``, ``direct``, ``staging_bytes``, ..., or ``options``).
    """
    import os

    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    names = [os.fsdecode(os.fspath(p)) for p in paths]
    if not names:
        raise ValueError("no path given")
    req = request(options=options, **load_options)
    return _core.prefetch([os.fsencode(p) for p in names], _devices.key(device), req.options)


def convert(input, output, to: str = "fp8-e4m3fn", scale: str = "per-tensor", keep=(), threads: int = 8,
            variant: str = "") -> dict:
    """Writes an FP8 copy of a checkpoint (a file, an index, a model or pipeline folder) in ComfyUI's
    layout: ``<layer>.weight_scale`` (float32), ``<layer>.comfy_quant`` and ``_quantization_metadata``
    (include/pinload/convert.h, docs/fp8.md). ``to``: 'fp8-e4m3fn' or 'fp8-e5m2'; ``scale``:
    'per-tensor' or 'per-row'; ``keep``: patterns (globs or dotted names) kept as stored. The output
    (a file for a file, else a new folder) appears atomically. Returns counts: files,
    tensors_quantized, tensors_kept, bytes_in, bytes_out.
    """
    import os

    if isinstance(keep, str):
        keep = [keep]
    return _core.convert(os.fsencode(os.fspath(input)), os.fsencode(os.fspath(output)), to=to, scale=scale,
                         keep=[str(k) for k in keep], threads=threads, variant=variant)


def write_manifest(paths: Any, output: Any = None, *, variant: str = "",
                   piece_bytes: Any = None) -> Optional[str]:
    """The manifest of ``paths`` (files, indexes, folders; local): the SHA-256 of every file, of
    every tensor and of each 1 MiB piece of larger tensors, with the header's dtypes, shapes and
    byte ranges (docs/manifest.md). Written atomically to ``output`` (returns None), or returned as
    JSON text. A load given ``verify=<that file>`` checks every byte it reads against it and raises
    :class:`IntegrityError`, returning nothing, on a mismatch.
    """
    import os

    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    names = [os.fsencode(os.fspath(p)) for p in paths]
    if not names:
        raise ValueError("no path given")
    out = None if output is None else os.fsencode(os.fspath(output))
    return _core.write_manifest(names, out, variant=variant, piece_bytes=piece_bytes)


def store_status(socket: Any = None) -> dict:
    """The node store's status (docs/store.md): ``bytes`` it holds (count them once per node, as the
    daemon's), ``budget_bytes``, hits, misses, reads, clients and ``entries`` (path, bytes, holders,
    hits). ``socket``: its path; None: ``PINLOAD_STORE``, else the default socket. Raises
    :class:`UnavailableError` where no daemon answers."""
    import os

    if socket is None:
        env = os.environ.get("PINLOAD_STORE", "")
        socket = env if env not in ("", "0", "off", "false", "1", "default", "true", "on") else None
    return _core.store_status(os.fspath(socket) if socket is not None else _core.default_store_socket())


def cuda_available() -> tuple[bool, str]:
    """(available, reason): whether pinload itself can use a CUDA device, and why not."""
    return _core.cuda_available()


# pinload.lora (docs/lora.md): LoRA adapters kept in the pool, fused in place, unfused by restoring.
_LAZY.update(LoraLibrary="lora", LoraFuser="lora")
_SUBMODULES += ("lora",)
__all__ += ["LoraFuser", "LoraLibrary"]
if TYPE_CHECKING:
    from . import lora  # noqa: F401
    from .lora import LoraFuser, LoraLibrary  # noqa: F401

# pinload.patch_safetensors (docs/python.md): safetensors' own loaders through pinload, for the whole process.
_LAZY.update(patch_safetensors="safetensors_hook")
__all__ += ["patch_safetensors"]
if TYPE_CHECKING:
    from .safetensors_hook import patch_safetensors  # noqa: F401
