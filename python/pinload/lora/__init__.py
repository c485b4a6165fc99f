"""LoRA adapters kept in pinload's pool, fused into a model's weights in place, unfused by restoring.

``LoraLibrary(budget)`` loads adapter files with ``load_files_batch`` (one parallel sweep for the
misses of a request; the tensors are views of pool blocks) and keeps them LRU within a byte budget,
keyed by file identity (device, inode, size, mtime, ctime). ``LoraFuser(model, base)`` fuses a list of
``(adapter, scale)`` into the model's weights where they live (CPU, ``sim``, CUDA), without
constructing PEFT modules:

    W = base + sum(scale * alpha / rank * (up @ down))   (float32 accumulation, stored in W's dtype)

and unfuses by copying the touched weights back from the pristine copy ``base`` (the base model's
bytes in pinload's pool or a ``ModelCache``), so any sequence of switches leaves the weights
bit-identical to the base. FP8 weights with a ``weight_scale`` (the layout ``pinload convert``
writes) are dequantised, added to and re-quantised on their device with the documented
conversion. See docs/lora.md.

The package: ``library`` (adapters kept in the pool), ``keys`` (their key layouts resolved against a
model) and ``fuser`` (the switch, Notes [Switch by recomputing from the base], [Validate before
writing] and [Atomic switches]).
"""

from ._errors import LoraKeyError, LoraShapeError, LoraValueError
from .fuser import LoraFuser
from .library import LoraAdapter, LoraLibrary

__all__ = ["LoraAdapter", "LoraFuser", "LoraKeyError", "LoraLibrary", "LoraShapeError", "LoraValueError"]
