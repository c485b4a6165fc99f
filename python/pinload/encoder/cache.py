"""The embedding cache: LRU, bounded in bytes.

Note [Embedding cache key]
A key is (encoder identity, tokenizer identity, max length, padding, truncation, hidden layer,
prompt). The encoder's identity hashes its config.json, every safetensors header, the dtype it
serves in and a sample of each tensor's bytes (Note [Encoder identity] in model.py); the tokenizer's
hashes its files. A cache keyed on the prompt alone serves stale embeddings once the encoder, its
precision or its tokenizer changes; with this key an entry can only be found by the encoder that
made it. Values are the tensors of the first answer, never recomputed, so a hit is bit-identical.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Dict, Optional

from .model import EncodeSpec, nbytes

__all__ = ["EmbeddingCache", "cache_key"]


def cache_key(identity: str, spec: EncodeSpec, prompt: str) -> str:
    """``identity`` is ``Encoder.identity`` (encoder and tokenizer)."""
    h = hashlib.sha256()
    h.update(identity.encode() + b"\0" + spec.key().encode() + b"\0" + prompt.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class EmbeddingCache:
    """``capacity`` bytes of per-prompt results, least recently used first out. An entry larger than
    the whole capacity is not kept. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity {capacity} < 0")
        self.capacity = int(capacity)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: "OrderedDict[str, tuple]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: Dict[str, Any]) -> None:
        size = nbytes(value)
        with self._lock:
            if size > self.capacity:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.capacity:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "capacity": self.capacity,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
