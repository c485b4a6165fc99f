"""Load options: :class:`pinload.LoadOptions` is the C++ ``LoadOptions``, checked there once
(``LoadOptions::validate``); sizes go through the C++ size parser. No torch import here.

Every load takes the options as keyword arguments (``threads=4``, typed by :class:`LoadKwargs`)
or as one ``options=LoadOptions(...)`` object, plus ``progress`` and ``prefetch``.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, TypedDict, Union

from . import _core

LoadOptions = _core.LoadOptions


class LoadKwargs(TypedDict, total=False):
    """The keyword arguments of :class:`pinload.LoadOptions`, as every load takes them; the defaults
    are those of the C++ core (``_core.DEFAULT_*``)."""

    threads: int  # reader threads, 1..1024 (8)
    block_size: Union[int, str]  # bytes per read, 4 KiB..1 GiB, an int or "4M" (8 MiB)
    direct: Union[str, bool]  # O_DIRECT reads: "auto" (unless cached), "on", "off"
    files_in_flight: int  # shards read at once (2)
    streams: int  # host-to-device copy streams, 1..64 (2)
    chunk_bytes: Union[int, str]  # bytes per host-to-device copy (8 MiB)
    staging_bytes: Union[int, str, None]  # streaming mode for device loads: host memory cap
    variant: Optional[str]  # "fp16" loads *.fp16.safetensors
    dtype: Any  # convert floating tensors on load: torch.bfloat16, torch.float16, torch.float32 (None: as stored)
    keep: Union[str, Iterable[str]]  # name patterns not converted to dtype
    keep_dtype: Any  # the dtype of the kept tensors (None: as stored)
    pool_bytes: Union[int, str, None]  # the budget of the load's pool (None: the device's shared pool)
    zero_copy: Union[str, bool]  # host files as leased file mappings: "auto", "on", "off" (Note [Zero-copy loads])
    verify: Any  # a manifest's path, or {file name: sha256} of whole files (docs/manifest.md)
    page_cache: str  # cold files: "auto", "keep" (left in the page cache), "bypass" (O_DIRECT) (Note [Keeping the page cache])
    store: Any  # the node store's socket path, True for the default one, None: PINLOAD_STORE (docs/store.md)
    store_required: bool  # raise UnavailableError where the store cannot be reached (False: load without it)
    connections: Optional[int]  # parallel connections for remote files, 1..1024 (None: PINLOAD_CONNECTIONS, else 16)


class Request(NamedTuple):
    """What one load call was given, checked."""

    options: "_core.LoadOptions"
    progress: bool
    prefetch: Optional["_core.Prefetch"]


def request(*, progress: bool = False, prefetch: Optional["_core.Prefetch"] = None,
            options: Optional["_core.LoadOptions"] = None, **load_options: Any) -> Request:
    """The options of a load: ``options`` or ``LoadOptions(**load_options)`` (not both). Raises
    TypeError for an unknown option, pinload.InvalidArgumentError for a value out of range."""
    if options is None:
        options = _core.LoadOptions(**load_options)
    elif not isinstance(options, _core.LoadOptions):
        raise TypeError(f"options must be a pinload.LoadOptions, not {type(options).__name__}")
    elif load_options:
        raise TypeError(f"pass load options as options= or as keywords, not both: {sorted(load_options)}")
    if prefetch is not None and not isinstance(prefetch, _core.Prefetch):
        raise TypeError(f"prefetch must be a pinload.prefetch(...) handle, not {type(prefetch).__name__}")
    return Request(options, bool(progress), prefetch)


def size(value: Union[int, str], what: str) -> int:
    """Bytes from an int >= 0 or a size string ("64K", "8M"); InvalidArgumentError naming ``what``."""
    return _core.parse_size(value, what)
