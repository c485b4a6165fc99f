"""Load options shared by pinload.torch and pinload.prefetch, checked once (no torch import)."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

from . import _core

_SIZE_UNITS = {"": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}


def _size(value: Union[int, str], what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a size such as '2M', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be >= 0, not {value}")
        return value
    if isinstance(value, str):
        text = value.strip()
        digits = len(text) - len(text.lstrip("0123456789"))
        unit = text[digits:].strip().upper()
        if digits and unit in _SIZE_UNITS:
            return int(text[:digits]) * _SIZE_UNITS[unit]
        raise ValueError(f"{what}: not a size: {value!r} (use bytes or K, M, G)")
    raise TypeError(f"{what} must be an int or a size such as '2M', not {type(value).__name__}")


_DTYPE_NAMES = {
    "bfloat16": "BF16", "bf16": "BF16", "BF16": "BF16",
    "float16": "F16", "half": "F16", "fp16": "F16", "F16": "F16",
    "float32": "F32", "float": "F32", "fp32": "F32", "F32": "F32",
}


def _dtype_name(dtype: Any) -> str:
    """'' (as stored) or the format's spelling of a torch dtype or name: 'BF16', 'F16', 'F32'."""
    if dtype is None:
        return ""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32 (or None), not {dtype!r}")
    return _DTYPE_NAMES[text]


class _Options:
    """Load options, checked once."""

    __slots__ = ("threads", "block_size", "direct", "files_in_flight", "streams", "chunk_bytes",
                 "staging_bytes", "variant", "progress", "prefetch", "dtype", "keep", "keep_dtype", "pool_bytes",
                 "zero_copy")

    def __init__(
        self,
        threads: int = _core.DEFAULT_THREADS,
        block_size: Union[int, str] = _core.DEFAULT_BLOCK_SIZE,
        direct: str = "auto",
        files_in_flight: int = 2,
        streams: int = _core.DEFAULT_STREAMS,
        chunk_bytes: Union[int, str] = _core.DEFAULT_CHUNK_BYTES,
        staging_bytes: Union[int, str, None] = None,
        variant: Optional[str] = None,
        progress: bool = False,
        prefetch: Optional["_core.Prefetch"] = None,
        dtype: Any = None,
        keep: Iterable[str] = (),
        keep_dtype: Any = None,
        pool_bytes: Union[int, str, None] = None,
        zero_copy: str = "auto",
    ):
        if not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"threads must be 1..1024, not {threads!r}")
        self.threads = threads
        self.block_size = _size(block_size, "block_size")
        if not (4096 <= self.block_size <= 1 << 30):
            raise ValueError(f"block_size must be 4 KiB..1 GiB, not {block_size!r}")
        if direct is True or direct is False:
            direct = "on" if direct else "off"
        if direct not in ("auto", "on", "off"):
            raise ValueError(f"direct must be 'auto', 'on' or 'off', not {direct!r}")
        self.direct = direct
        if not isinstance(files_in_flight, int) or files_in_flight < 1:
            raise ValueError(f"files_in_flight must be >= 1, not {files_in_flight!r}")
        self.files_in_flight = files_in_flight
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise ValueError(f"streams must be 1..64, not {streams!r}")
        self.streams = streams
        self.chunk_bytes = _size(chunk_bytes, "chunk_bytes")
        if self.chunk_bytes == 0:
            raise ValueError("chunk_bytes must be > 0")
        self.staging_bytes = None if staging_bytes is None else _size(staging_bytes, "staging_bytes")
        self.variant = variant or ""
        self.progress = bool(progress)
        if prefetch is not None and not isinstance(prefetch, _core.Prefetch):
            raise TypeError(f"prefetch must be a pinload.prefetch(...) handle, not {type(prefetch).__name__}")
        self.prefetch = prefetch
        # The budget of the pool the load's blocks come from (None: the shared pool, no budget); a
        # load that cannot fit it fails with OutOfMemoryError before reading.
        self.pool_bytes = None if pool_bytes is None else _size(pool_bytes, "pool_bytes")
        if self.pool_bytes == 0:
            raise ValueError("pool_bytes must be > 0")
        # Host loads: files handed out as leased file mappings (Note [Zero-copy loads]).
        if zero_copy is True or zero_copy is False:
            zero_copy = "on" if zero_copy else "off"
        if zero_copy not in ("auto", "on", "off"):
            raise ValueError(f"zero_copy must be 'auto', 'on' or 'off', not {zero_copy!r}")
        self.zero_copy = zero_copy
        self.dtype = _dtype_name(dtype)
        if isinstance(keep, str):
            keep = [keep]
        self.keep = [str(k) for k in keep]
        self.keep_dtype = _dtype_name(keep_dtype)
        if (self.keep or self.keep_dtype) and not self.dtype:
            raise ValueError("keep and keep_dtype need dtype: they name tensors not converted to it")

    def convert_kwargs(self) -> dict:
        """The conversion-on-load arguments of _core.load_async (Note [Conversion on load])."""
        return dict(dtype=self.dtype, keep=self.keep, keep_dtype=self.keep_dtype)

    def reader_kwargs(self) -> dict:
        """The keyword arguments of the reader that every _core entry point takes."""
        return dict(threads=self.threads, block_size=self.block_size, direct=self.direct,
                    files_in_flight=self.files_in_flight, variant=self.variant)

    def load_kwargs(self) -> dict:
        """reader_kwargs() plus the device copy options: what _core.load_async and prefetch take."""
        return dict(self.reader_kwargs(), streams=self.streams, chunk_bytes=self.chunk_bytes,
                    staging_bytes=self.staging_bytes, pool_bytes=self.pool_bytes)
