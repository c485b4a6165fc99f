"""The LoRA errors: typed, naming the adapter file and its key."""

from __future__ import annotations

from typing import Optional

from .._core import InvalidFileError


class LoraKeyError(InvalidFileError):
    """An adapter key that names no weight of the model (or a layout this module cannot read):
    ``.file`` is the adapter, ``.tensor`` the key. Raised before any weight is written."""


class LoraShapeError(InvalidFileError):
    """An adapter's ``up``/``down`` pair whose shapes do not fit the weight it names: ``.file`` is the
    adapter, ``.tensor`` the key. Raised before any weight is written."""


class LoraValueError(InvalidFileError):
    """An adapter tensor holding NaN or infinity (refused unless ``LoraFuser(allow_nonfinite=True)``),
    or an alpha that is not a finite number: ``.file`` is the adapter, ``.tensor`` the key. Raised
    before any weight is written."""


def _err(cls, message: str, *, file: Optional[str] = None, tensor: Optional[str] = None):
    text = (f"{file}: " if file else "") + (f"tensor '{tensor}': " if tensor else "") + message
    e = cls(text)
    e.file, e.tensor, e.message = file, tensor, message
    e.begin = e.end = None
    return e
