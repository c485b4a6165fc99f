"""Rank-aware loading for ``torch.distributed`` jobs: each rank reads only its share.

Two modes (include/pinload/shard.h, Note [Shard modes]; docs/serving.md):

- ``mode="slice"``: each rank reads its slice of every tensor a rule splits (rules as vLLM's
  column-parallel, dim 0, and row-parallel, dim 1, layers) and the whole of every other tensor.
  Needs no process group.
- ``mode="share"``: split tensors as above; each replicated tensor is read by one rank (its owner,
  by contiguous byte ranges) and broadcast to the others through the process group (gloo on CPU,
  NCCL on GPU). No byte is read twice across the ranks.

``iter_sharded`` yields ``(name, tensor)`` batch by batch; ``batch_bytes`` (and ``window_bytes`` in
share mode) bound the memory in flight, the streaming budget of a sharded load. A peer that dies or
stalls makes every other rank raise :class:`PeerError` (a :class:`pinload.Error`) within
``peer_timeout`` seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import Error, _core
from . import _torch_tensors as _tt
from ._loading import as_paths
from ._options import size as _size

# vLLM's tensor-parallel layout of Llama-style decoders: column-parallel layers split their output
# features (dim 0 of the weight), row-parallel ones their input features (dim 1).
LLAMA_TP_RULES: List[Tuple[str, int]] = [
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"(embed_tokens|lm_head)\.weight$", 0),
    (r"\.(o_proj|down_proj)\.weight$", 1),
]

REPLICATED = -1


class PeerError(Error):
    """Another rank failed, died or stalled while the ranks exchanged tensors."""


def _peer_error(message: str, tensor: Optional[str]) -> PeerError:
    e = PeerError(message)
    e.file, e.tensor, e.begin, e.end, e.code, e.message = None, tensor, None, None, "peer", message
    return e


def _rank_and_world(rank: Optional[int], world_size: Optional[int], group) -> Tuple[int, int]:
    import torch.distributed as dist

    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        else:
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return rank, world_size


class _Tensor:
    __slots__ = ("name", "dtype", "shape", "dim", "begin", "end", "owner", "window", "read", "batch")

    def __init__(self, row) -> None:
        (self.name, self.dtype, self.shape, self.dim, self.begin, self.end, self.owner, self.window, self.read,
         self.batch) = row

    def part_shape(self) -> List[int]:
        shape = list(self.shape)
        if self.dim != REPLICATED:
            shape[self.dim] = self.end - self.begin
        return shape


class ShardedLoad:
    """One rank's share of a checkpoint. Iterate it for ``(name, tensor)``; ``bytes_read`` and
    ``planned_bytes`` say what this rank read. Use :func:`iter_sharded` unless you need those."""

    def __init__(self, paths, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                 mode: str = "slice", rules: Optional[Sequence[Tuple[str, int]]] = None, group=None,
                 device: Union[str, torch.device, None] = None, batch_bytes: Union[int, str] = 0,
                 window_bytes: Union[int, str] = 0, peer_timeout: float = 300.0, threads: int = _core.DEFAULT_THREADS,
                 block_size: Union[int, str] = _core.DEFAULT_BLOCK_SIZE, direct: str = "auto",
                 max_gap: Union[int, str] = 0) -> None:
        if mode not in ("slice", "share"):
            raise ValueError(f"mode must be 'slice' or 'share', not {mode!r}")
        self.rank, self.world_size = _rank_and_world(rank, world_size, group)
        self.mode = mode
        self.group = group
        self.peer_timeout = float(peer_timeout)
        self.rules = list(LLAMA_TP_RULES if rules is None else rules)
        self._paths = as_paths(paths)
        if device is None:
            device = "cpu"
            if mode == "share":
                import torch.distributed as dist

                if dist.is_initialized() and dist.get_backend(group) == "nccl":
                    device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if direct is True or direct is False:
            direct = "on" if direct else "off"
        self._load = _core.shard_load(
            [os.fsencode(p) for p in self._paths], self.rank, self.world_size, mode=mode,
            rules=[(str(p), int(d)) for p, d in self.rules], window_bytes=_size(window_bytes, "window_bytes"),
            threads=threads, block_size=_size(block_size, "block_size"), direct=direct,
            max_gap=_size(max_gap, "max_gap"), batch_bytes=_size(batch_bytes, "batch_bytes"))
        self.tensors = [_Tensor(row) for row in self._load.tensors()]

    @property
    def bytes_read(self) -> int:
        return self._load.bytes_read

    @property
    def planned_bytes(self) -> int:
        return self._load.planned_bytes

    def _batches(self) -> Iterator[Dict[str, torch.Tensor]]:
        file = self._paths[0] if len(self._paths) == 1 else ", ".join(self._paths)
        while True:
            sd = self._load.next()
            if sd is None:
                return
            out = {}
            for name, dtype, shape, capsule in sd.export_all():
                torch_dtype = _tt.torch_dtype(dtype, name, file)
                if capsule is None:
                    out[name] = torch.empty(shape, dtype=torch_dtype)
                else:
                    out[name] = torch.from_dlpack(capsule).view(torch_dtype).reshape(shape)
            del sd
            yield out

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        batches = self._batches()
        current: Dict[str, torch.Tensor] = {}
        current_batch = -1
        for t in self.tensors:
            tensor = None
            if t.read:
                while current_batch < t.batch:
                    current = next(batches)
                    current_batch += 1
                tensor = current.pop(t.name)
            if self.mode == "share" and t.dim == REPLICATED:
                tensor = self._exchange(t, tensor)
            elif self.device.type != "cpu":
                tensor = tensor.to(self.device)
            yield t.name, tensor
        for _ in batches:  # the empty tail: every batch handed out
            pass

    def _exchange(self, t: _Tensor, tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Broadcasts a replicated tensor from its owner; bytes travel as uint8, so every dtype goes."""
        import torch.distributed as dist

        dtype = _tt.torch_dtype(t.dtype, t.name, None)
        if t.owner == self.rank:
            buf = tensor.to(self.device) if self.device.type != "cpu" else tensor
        else:
            buf = torch.empty(t.shape, dtype=dtype, device=self.device)
        if buf.numel() == 0:
            return buf
        flat = buf.reshape(-1).view(torch.uint8) if buf.element_size() > 0 else buf
        src = t.owner if self.group is None else dist.get_global_rank(self.group, t.owner)
        try:
            work = dist.broadcast(flat, src=src, group=self.group, async_op=True)
            if not work.wait(timeout=datetime.timedelta(seconds=self.peer_timeout)):
                raise RuntimeError("timed out")
        except Error:
            raise
        except Exception as e:  # noqa: BLE001 - gloo and NCCL raise RuntimeError and their own types
            raise _peer_error(
                f"rank {self.rank}: exchanging {t.name!r} (owner rank {t.owner}) failed: {e}", t.name) from e
        return buf


def iter_sharded(paths, **options: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` of this rank's share of ``paths`` (files, indexes, folders): split
    tensors as this rank's slice, replicated ones whole. Options: ``rank``, ``world_size`` (default:
    the process group's, else $RANK/$WORLD_SIZE), ``mode`` ('slice' or 'share'), ``rules`` ((regex,
    dim) pairs, dim -1 replicated; default LLAMA_TP_RULES), ``group``, ``device``, ``batch_bytes``,
    ``window_bytes``, ``peer_timeout`` (seconds), ``threads``, ``block_size``, ``direct``, ``max_gap``.
    """
    return iter(ShardedLoad(paths, **options))


def load_sharded(paths, **options: Any) -> Dict[str, torch.Tensor]:
    """``dict(iter_sharded(paths, **options))``."""
    return dict(iter_sharded(paths, **options))


def slice_of(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """The rows ``[n*rank/world, n*(rank+1)/world)`` of ``dim``: what a split rule gives a rank."""
    if dim == REPLICATED:
        return tensor
    n = tensor.shape[dim]
    return tensor.narrow(dim, n * rank // world_size, n * (rank + 1) // world_size - n * rank // world_size)
