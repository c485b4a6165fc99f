"""``pinload.patch_safetensors()``: every ``safetensors.safe_open`` (and ``safetensors.torch.safe_open``),
``safetensors.torch.load_file`` and ``safetensors.torch.load`` call of the process through pinload,
for UIs and libraries that read
checkpoints with safetensors themselves (ComfyUI's ``comfy.utils.load_torch_file``, A1111's
``read_state_dict``, Forge's ``backend.utils.load_torch_file``; docs/python.md, examples/comfyui/,
examples/webui/).

    patch = pinload.patch_safetensors(threads=16)   # before the UI's modules are imported
    ...
    patch.counts()    # {'safetensors.safe_open': 3, 'files': 3}: the calls pinload served
    patch.undo()      # or: with pinload.patch_safetensors(): ...

Note [Patching safetensors' module attributes]
The replacements are set as attributes of the ``safetensors`` and ``safetensors.torch`` modules, so
a call through the module (``safetensors.safe_open(...)``, ``safetensors.torch.load_file(...)``, as
ComfyUI and the webuis make them) finds them, whenever it was imported. ``safetensors.torch``
re-exports ``safe_open``: that name is routed too (and the original ``load_file``, where a call falls
back to it, then opens its file through the routed ``safe_open``, which hands it on again). A name a module bound
before the patch (``from safetensors import safe_open`` at its import) still holds the original: it
cannot be told apart from an unrelated object without walking every module of the process, which
this does not do. So the patch goes first, before the UI's modules are imported (ComfyUI's custom
nodes are imported after comfy.utils, which calls through the module, so a node's patch is early
enough). transformers and diffusers import ``safe_open`` by name: ``patch_diffusers`` /
``patch_transformers`` route those.

Exactness: a pinload handle has the reference's methods (``keys``, ``offset_keys``, ``metadata``,
``get_tensor``, ``get_tensors``, ``get_slice``), takes ``framework="pt"`` or ``"np"`` and the
``device`` and ``backend`` arguments, and gives the same tensors (bytes, dtypes, shapes, order) and
metadata (tests/python/test_patch_safetensors.py). What pinload does not serve goes to the
original, uncounted but for ``fallbacks``: another framework, a device pinload does not load to,
an argument it does not know, and any file pinload refuses (missing, malformed: the reference then
raises its own error, worded as the UI expects) or a tensor it cannot hand out.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional

from .hooks import Patch, _pinload_device

__all__ = ["SafetensorsPatch", "patch_safetensors"]

_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")
_NUMPY_FRAMEWORKS = ("np", "numpy")


class SafetensorsPatch(Patch):
    """The Patch of ``patch_safetensors``: ``counts()`` holds the calls pinload served (and
    ``files``, the files it loaded); ``fallbacks`` the calls (or a handle's tensors) it handed to
    the original safetensors function."""

    def __init__(self) -> None:
        super().__init__("safetensors")
        self.fallbacks: Dict[str, int] = {}

    def fell_back(self, what: str) -> None:
        with self._lock:
            self.fallbacks[what] = self.fallbacks.get(what, 0) + 1


def _open_arguments(filename, framework, device="cpu", backend=None):
    """The reference safe_open's parameters (safetensors 0.8), to bind a call's arguments."""


_OPEN_SIGNATURE = inspect.signature(_open_arguments)


def _served(framework: Any, device: Any) -> bool:
    if framework in _NUMPY_FRAMEWORKS:
        return device in ("cpu", None) or str(device) == "cpu"
    return framework in _TORCH_FRAMEWORKS and _pinload_device(device)


def _handle_class(patch: SafetensorsPatch):
    """pinload's safe_open, counting its loads and handing a tensor it cannot give to the original."""
    from . import Error
    from .torch import safe_open

    class Handle(safe_open):
        def __init__(self, original: Callable, args: tuple, kwargs: dict, filename: Any, framework: str,
                     device: Any, backend: Optional[str], options: Dict[str, Any]) -> None:
            self._original_call = (original, args, kwargs)
            self._reference: Any = None
            super().__init__(filename, framework=framework, device=device, backend=backend, **options)

        def _loaded(self) -> None:
            patch.count("files")

        def _fallback(self) -> Any:
            with self._lock:
                self._check_open()
                if self._reference is None:
                    original, args, kwargs = self._original_call
                    self._reference = original(*args, **kwargs)
                return self._reference

        def get_tensor(self, name: str) -> Any:
            try:
                return super().get_tensor(name)
            except Error:
                if self._closed or name not in self._info:  # the reference's errors, worded as its
                    raise
            patch.fell_back("safetensors.safe_open.get_tensor")
            return self._fallback().get_tensor(name)

        def get_tensors(self) -> Dict[str, Any]:
            self._check_open()
            return {name: self.get_tensor(name) for name in self._offset_order}

        def close(self) -> None:
            super().close()
            reference, self._reference = getattr(self, "_reference", None), None
            if reference is not None and hasattr(reference, "__exit__"):
                reference.__exit__(None, None, None)

    return Handle


class _EitherHandle(type):
    """isinstance(x, the patched safe_open) holds for pinload's handles and the original's."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._instance_types)  # type: ignore[attr-defined]


def _routed_safe_open(original: Any, patch: SafetensorsPatch, options: Dict[str, Any]) -> Any:
    from . import Error

    handle = _handle_class(patch)

    class safe_open(metaclass=_EitherHandle):  # noqa: N801 (the reference's name)
        _pinload_original = original
        _instance_types = (handle, original) if isinstance(original, type) else (handle,)

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                a = _OPEN_SIGNATURE.bind(*args, **kwargs).arguments
            except TypeError:
                a = None
            if a is not None and _served(a["framework"], a.get("device", "cpu")):
                try:
                    opened = handle(original, args, kwargs, a["filename"], a["framework"], a.get("device", "cpu"),
                                    a.get("backend"), options)
                except Error:
                    pass  # the reference opens it, or raises its own error
                else:
                    patch.count("safetensors.safe_open")
                    return opened
            patch.fell_back("safetensors.safe_open")
            return original(*args, **kwargs)

    safe_open.__doc__ = original.__doc__
    return safe_open


def _routed_load_file(original: Callable, patch: SafetensorsPatch, options: Dict[str, Any]) -> Callable:
    from . import Error

    @functools.wraps(original)
    def load_file(filename, device="cpu", **kwargs):
        backend = kwargs.pop("backend", None)
        if not kwargs and _pinload_device(device):
            from .torch import load_file as pinload_load_file

            try:
                result = pinload_load_file(filename, device=device, backend=backend, **options)
            except Error:
                pass
            else:
                patch.count("safetensors.torch.load_file")
                patch.count("files")
                return result
        patch.fell_back("safetensors.torch.load_file")
        if backend is not None:
            kwargs["backend"] = backend
        return original(filename, device, **kwargs)

    load_file._pinload_original = original  # type: ignore[attr-defined]
    return load_file


def _routed_load(original: Callable, patch: SafetensorsPatch, options: Dict[str, Any]) -> Callable:
    from . import Error

    @functools.wraps(original)
    def load(data, *args, **kwargs):
        if not args and not kwargs and isinstance(data, (bytes, bytearray)):
            from .torch import load as pinload_load

            try:
                result = pinload_load(bytes(data), **options)
            except Error:
                pass
            else:
                patch.count("safetensors.torch.load")
                patch.count("files")
                return result
        patch.fell_back("safetensors.torch.load")
        return original(data, *args, **kwargs)

    load._pinload_original = original  # type: ignore[attr-defined]
    return load


def patch_safetensors(**options: Any) -> SafetensorsPatch:
    """Routes ``safetensors.safe_open`` and its re-export ``safetensors.torch.safe_open`` (frameworks
    "pt" and "np"), ``safetensors.torch.load_file``
    and ``safetensors.torch.load`` through pinload for the whole process, until ``undo()`` (or the
    end of a ``with`` block). ``options`` are pinload load options (threads, block_size, direct,
    dtype, ...), checked now. Call it before the modules that read checkpoints are imported (Note
    [Patching safetensors' module attributes]). Returns a SafetensorsPatch: ``counts()`` (calls
    pinload served, ``files`` loaded), ``fallbacks``, ``undo()``.
    """
    from ._options import request

    request(**options)  # check them now
    import safetensors
    import safetensors.torch

    patch = SafetensorsPatch()
    try:
        original = safetensors.safe_open
        routed = _routed_safe_open(original, patch, options)
        patch._replace(safetensors, "safe_open", routed)
        if getattr(safetensors.torch, "safe_open", None) is original:  # its re-export (`from safetensors import safe_open`)
            patch._replace(safetensors.torch, "safe_open", routed)
        patch._replace(safetensors.torch, "load_file", _routed_load_file(safetensors.torch.load_file, patch, options))
        patch._replace(safetensors.torch, "load", _routed_load(safetensors.torch.load, patch, options))
    except BaseException:
        patch.undo()
        raise
    return patch
