"""The adapter library: ``LoraLibrary(budget)`` loads adapter files with ``load_files_batch`` (one
parallel sweep for the misses of a request; the tensors are views of pool blocks) and keeps them LRU
within a byte budget, keyed by file identity (device, inode, size, mtime, ctime)."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _core
from .._options import LoadKwargs, LoadOptions, request, size
from ._errors import _err

if TYPE_CHECKING:
    from typing_extensions import Unpack


PathLike = Union[str, "os.PathLike[str]", bytes]

log = logging.getLogger("pinload.lora")



#: (device, inode, size, mtime, ctime): a file rewritten in place with its mtime set back still
#: has a new ctime, which no caller can set.
_Identity = Tuple[int, int, int, int, int]


def _identity(path: str) -> _Identity:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _size_class(n: int) -> int:
    """The pool block a request of n bytes takes (Note [Size classes] in include/pinload/pool.h): 4 KiB
    granules up to 64 KiB, then 8 classes per power of two."""
    if n <= 64 << 10:
        return max(4096, -(-n // 4096) * 4096)
    step = (1 << ((n - 1).bit_length() - 1)) // 8
    return -(-n // step) * step


class LoraAdapter:
    """One adapter file in memory: its tensors as stored (views of a pool block), its metadata,
    and the key conversions already made for the models it was fused into."""

    def __init__(self, path: str, identity: _Identity, tensors: Dict[str, torch.Tensor],
                 metadata: Optional[Dict[str, str]], data_bytes: Optional[int] = None) -> None:
        self.path = path
        self.identity = identity
        self.tensors = tensors
        self.metadata = metadata or {}
        # The pool block that holds the file's data section, read as an aligned superset of it (a
        # header can be a tenth of a LoRA file).
        self.nbytes = _size_class(identity[2] if data_bytes is None else data_bytes)
        self._resolved: Dict[Any, List[Any]] = {}  # a target -> its keys._Entry list
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<pinload.lora.LoraAdapter {self.path!r} {len(self.tensors)} tensors, {self.nbytes} bytes>"


class LoraLibrary:
    """Adapter files in pinload's pool, least recently used evicted beyond ``budget_bytes``.

    ``get(path)`` / ``get_many(paths)`` stat each file (no read) and return the cached adapter when
    the file's identity (device, inode, size, mtime, ctime) is unchanged; the misses of one call are read
    in one ``load_files_batch`` sweep. An adapter larger than the whole budget is returned but not
    kept. ``device``: where the tensors are loaded ("cpu", "sim", "cuda:N"). Load options as for
    ``load_files_batch``; ``zero_copy`` is "off" unless given, so that the adapters are in pool
    blocks (not file mappings, Note [Zero-copy loads] in loader.h). Thread-safe.
    """

    def __init__(self, budget_bytes: Union[int, str], *, device: Any = "cpu", options: Optional[LoadOptions] = None,
                 **load_options: "Unpack[LoadKwargs]") -> None:
        self._budget = size(budget_bytes, "budget_bytes")
        self._device = device
        if options is None:  # in the pool, where the budget counts them: not as file mappings
            load_options.setdefault("zero_copy", "off")  # type: ignore[typeddict-item]
        self._options = request(options=options, **load_options).options
        self._entries: "collections.OrderedDict[_Identity, LoraAdapter]" = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "evictions": 0, "invalidations": 0, "too_large": 0}
        self._aliases: Dict[str, _Identity] = {}

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def stats(self) -> Dict[str, int]:
        """hits, misses, evictions, invalidations (a path whose file changed), too_large, entries,
        cached_bytes, budget_bytes."""
        with self._lock:
            return dict(self._stats, entries=len(self._entries), cached_bytes=self._bytes, budget_bytes=self._budget)

    def __contains__(self, path: PathLike) -> bool:
        try:
            key = _identity(os.fsdecode(os.fspath(path)))
        except OSError:
            return False
        with self._lock:
            return key in self._entries

    def evict(self, path: PathLike) -> bool:
        """Drops the adapter of ``path`` (as its file is now); False if it is not cached."""
        try:
            key = _identity(os.fsdecode(os.fspath(path)))
        except OSError:
            return False
        with self._lock:
            a = self._entries.pop(key, None)
            if a is None:
                return False
            self._bytes -= a.nbytes
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def get(self, path: Union[PathLike, LoraAdapter]) -> LoraAdapter:
        return self.get_many([path])[0]

    def get_many(self, paths: Sequence[Union[PathLike, LoraAdapter]]) -> List[LoraAdapter]:
        """The adapters of ``paths``, in order: cached ones as they are, the rest read in one batch."""
        from ..torch import load_files_batch, safe_open

        out: List[Optional[LoraAdapter]] = []
        missing: Dict[str, _Identity] = {}
        with self._lock:
            for p in paths:
                if isinstance(p, LoraAdapter):
                    out.append(p)
                    continue
                name = os.fsdecode(os.fspath(p))
                try:
                    key = _identity(name)
                except FileNotFoundError:
                    raise _err(_core.NotFoundError, "No such file or directory", file=name) from None
                old = self._aliases.get(name)
                if old is not None and old != key and old in self._entries:
                    self._bytes -= self._entries.pop(old).nbytes
                    self._stats["invalidations"] += 1
                self._aliases[name] = key
                a = self._entries.get(key)
                if a is not None:
                    self._entries.move_to_end(key)
                    self._stats["hits"] += 1
                    out.append(a)
                else:
                    out.append(None)
                    missing.setdefault(name, key)
        if missing:
            names = list(missing)
            with self._lock:
                self._stats["misses"] += len(names)
                need = sum(k[2] for k in missing.values() if k[2] <= self._budget)
                self._evict_to(self._budget - min(need, self._budget))
            loaded = load_files_batch(names, self._device, options=self._options)
            fresh: Dict[str, LoraAdapter] = {}
            for name in names:
                with safe_open(name) as f:  # the header alone: metadata (alphas, ranks of PEFT files)
                    metadata = f.metadata()
                with open(name, "rb") as raw:
                    header = int.from_bytes(raw.read(8), "little")
                # Direct reads take an aligned superset of the data section (loader.h): the block's request.
                data = -(-missing[name][2] // 4096) * 4096 - (8 + header) // 4096 * 4096
                fresh[name] = LoraAdapter(name, missing[name], loaded[name], metadata, data)
            with self._lock:
                for name, a in fresh.items():
                    if a.nbytes > self._budget:
                        self._stats["too_large"] += 1
                        continue
                    try:
                        changed = _identity(name) != a.identity
                    except OSError:
                        changed = True
                    if changed:  # the file changed while it was read: its bytes may be the new file's
                        self._stats["invalidations"] += 1
                        continue
                    if a.identity not in self._entries:
                        self._entries[a.identity] = a
                        self._bytes += a.nbytes
                    self._entries.move_to_end(a.identity)
                self._evict_to(self._budget)
            out = [o if o is not None else fresh[os.fsdecode(os.fspath(p))]  # type: ignore[arg-type]
                   for o, p in zip(out, paths)]
        return out  # type: ignore[return-value]

    def _evict_to(self, limit: int) -> None:
        while self._bytes > max(limit, 0) and self._entries:
            _, a = self._entries.popitem(last=False)
            self._bytes -= a.nbytes
            self._stats["evictions"] += 1

    def __repr__(self) -> str:
        s = self.stats()
        return f"<pinload.lora.LoraLibrary {s['entries']} adapters, {s['cached_bytes']}/{s['budget_bytes']} bytes>"
