"""A model cache for switching: host copies of recently used checkpoints in pinload's pinned pool.

``ModelCache(budget)`` keeps the host copies of the last models it loaded, under a budget of pool
bytes, and evicts the least recently used. Switching back to a cached model reads nothing from
storage: for ``device="cpu"`` it returns the cached tensors themselves (zero-copy), for a device
only the host-to-device copy is made. A file that changed (size, mtime, inode) is a miss. See
docs/cache.md and include/pinload/model_cache.h for the rules.

Tensors returned for "cpu" alias the cached blocks: do not write to them (the next ``get`` of the
same model returns the same memory). An evicted model's memory goes back to the pool once the
caller's tensors over it are gone too.
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Union

import torch

from . import _core, _devices
from ._options import LoadKwargs, LoadOptions, request
from ._loading import as_paths
from ._torch_tensors import Device, PathLike, check_dtypes, describe, resolve_device, yield_entries

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ModelCache"]


class ModelCache:
    """Host copies of recently used checkpoints, LRU under ``budget_bytes`` of pool memory.

    ``budget_bytes``: an int or a size such as "8G"; a model larger than the budget is loaded and
    returned but not cached. ``pool_device``: the device whose shared pinned pool holds the host
    copies ("cpu", or "cuda:N" so that copies to that GPU run at full speed). Load options
    (``threads``, ``connections``, ``block_size``, ``direct``, ``files_in_flight``, ``variant``;
    ``streams`` and ``chunk_bytes`` for gets to a device; or one ``options=pinload.LoadOptions(...)``) as for
    ``pinload.torch.load_files``. Thread-safe: concurrent gets of one missing model load it once.
    """

    def __init__(self, budget_bytes: Union[int, str], *, pool_device: Device = "cpu",
                 options: Optional[LoadOptions] = None, **load_options: "Unpack[LoadKwargs]") -> None:
        req = request(options=options, **load_options)
        self._core = _core.ModelCache(budget_bytes, _devices.key(pool_device), req.options)

    @staticmethod
    def _paths(paths: Union[PathLike, Iterable[PathLike]]):
        return [os.fsencode(p) for p in as_paths(paths)]

    def get(self, paths: Union[PathLike, Iterable[PathLike]], device: Device = "cpu") -> Dict[str, torch.Tensor]:
        """name -> tensor of ``paths`` (files, indexes, model or pipeline folders) on ``device``
        ("cpu", "sim", "cuda", "cuda:N", an int or a torch.device): from the cache on a hit, else
        loaded (and cached when it fits the budget)."""
        names = as_paths(paths)
        sd, move_to = self._state_dict(names, device)
        file = describe(names)
        return dict(yield_entries(collections.deque(sd.export_all()), check_dtypes(sd, file), sd.torch_device,
                                   move_to, file))

    def _state_dict(self, names, device: Device = "cpu"):
        """The cached state dict of ``names`` (as ``as_paths`` gives them) and the torch device to
        move its tensors to (pinload.hooks' safe_open serves a file from it)."""
        spec, move_to = resolve_device(device)
        return self._core.get([os.fsencode(p) for p in names], spec), move_to

    def contains(self, paths: Union[PathLike, Iterable[PathLike]]) -> bool:
        """Whether ``get(paths)`` would be served from the cache now (stats the files, reads nothing)."""
        return self._core.contains(self._paths(paths))

    __contains__ = contains

    def evict(self, paths: Union[PathLike, Iterable[PathLike]]) -> bool:
        """Drops the entry of ``paths`` (as passed to ``get`` before); False if there is none."""
        return self._core.evict(self._paths(paths))

    def clear(self) -> None:
        """Drops every entry; tensors handed out stay valid."""
        self._core.clear()

    @property
    def budget_bytes(self) -> int:
        return self._core.stats()["budget_bytes"]

    @budget_bytes.setter
    def budget_bytes(self, value: Union[int, str]) -> None:
        self._core.set_budget(value)

    def stats(self) -> Dict[str, int]:
        """hits, misses, waits (gets that shared a concurrent load), evictions, invalidations (files
        changed), too_large, entries, cached_bytes, budget_bytes, evicted_live_bytes (evicted models
        that callers still hold)."""
        return self._core.stats()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<pinload.ModelCache {s['entries']} models, {s['cached_bytes']}/{s['budget_bytes']} bytes>"
