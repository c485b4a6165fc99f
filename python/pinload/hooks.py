"""Route diffusers' and transformers' ``from_pretrained`` weight loading through pinload.

    with pinload.patch_diffusers():                      # also patches transformers (text encoders)
        pipe = DiffusionPipeline.from_pretrained("/models/sdxl")

    undo = pinload.patch_transformers(threads=16)        # or a plain call; undo.undo() restores
    model = LlamaForCausalLM.from_pretrained("/models/llama")

What is patched (checked against diffusers 0.42 and transformers 5.25; every module of the library
that imported the function by name gets the replacement, found by identity, after the modules
that are known to import it have been imported):

- diffusers: ``diffusers.models.model_loading_utils.load_state_dict`` (imported by name into
  ``models.modeling_utils`` and the ``loaders`` modules). ``ModelMixin.from_pretrained`` reads
  every ``.safetensors`` checkpoint and shard through it, ``DiffusionPipeline.from_pretrained``
  loads each diffusers component with ``ModelMixin.from_pretrained``, and ``from_single_file``
  (pipelines and models) reads the single file through it (``load_single_file_checkpoint`` is
  wrapped to count those loads apart). The LoRA, textual-inversion and attention-processor loaders
  call ``safetensors.torch.load_file`` through the module, and the IP-adapter loader ``safe_open``:
  Note [Reads through the safetensors module].
- transformers: ``safetensors.safe_open`` as imported by ``transformers.modeling_utils`` (the
  ``from_pretrained`` path: one handle per shard, ``get_slice(name)[...]`` per tensor, which a
  pinload handle serves from one parallel load of the whole shard), ``modeling_layers`` and
  ``integrations.accelerate``; ``transformers.modeling_utils.load_state_dict`` (safetensors
  files); and ``PreTrainedModel._load_pretrained_model`` for the ``disable_mmap`` / hf-mount path,
  where transformers would read each file whole and parse its bytes: pinload loads the files and
  hands them in as the ``state_dict`` argument, which transformers then takes as it takes the
  parsed bytes.

Anything the replacement does not handle (another framework, a ``meta`` or unsupported
device, a non-safetensors file) goes to the original function.

Each patch counts its calls in ``.calls`` (a dict: replacement name -> calls served by pinload;
``files`` counts the files pinload actually loaded); ``.counts()`` adds those of included patches.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Patch", "patch_diffusers", "patch_transformers"]

_DIFFUSERS_MODULES = (
    "diffusers.models.model_loading_utils",
    "diffusers.models.modeling_utils",
    "diffusers.loaders.single_file_utils",
    "diffusers.loaders.lora_base",
    "diffusers.loaders.unet",
    "diffusers.loaders.textual_inversion",
    "diffusers.loaders.ip_adapter",
    "diffusers.loaders.lora_pipeline",
    "diffusers.loaders.single_file",
    "diffusers.loaders.single_file_model",
    "diffusers.hooks.group_offloading",
)
_TRANSFORMERS_MODULES = (
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.integrations.accelerate",
)


class Patch:
    """A set of patched module attributes. ``undo()`` (or leaving the ``with`` block) restores them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: Dict[str, int] = {}
        self.patched: List[str] = []  # "module.attr" that were replaced
        self._undo: List[Tuple[Any, str, Any, Any]] = []
        self._lock = threading.Lock()
        self._children: List["Patch"] = []
        self.active = True

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.calls[what] = self.calls.get(what, 0) + n

    def counts(self) -> Dict[str, int]:
        """``calls`` merged with those of the patches this one includes (patch_diffusers'
        transformers patch)."""
        with self._lock:
            out = dict(self.calls)
        for child in self._children:
            for k, v in child.counts().items():
                out[k] = out.get(k, 0) + v
        return out

    def _replace(self, module: Any, attr: str, new: Any) -> None:
        # A class's own attribute as stored (a classmethod object, not the bound method).
        old = module.__dict__[attr] if isinstance(module, type) else getattr(module, attr)
        setattr(module, attr, new)
        self._undo.append((module, attr, old, new))
        self.patched.append(f"{module.__name__}.{attr}")

    def undo(self) -> None:
        """Restores every attribute this patch replaced (and those of the patches it includes)."""
        if not self.active:
            return
        for child in reversed(self._children):
            child.undo()
        for module, attr, old, new in reversed(self._undo):
            if getattr(module, attr, None) is new or module.__dict__.get(attr) is new:
                setattr(module, attr, old)
        self._undo.clear()
        self.active = False

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<pinload.Patch {self.name} {state}: {len(self.patched)} attributes, calls={self.calls}>"


def _import_all(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # an optional loader whose own dependencies are missing
            pass


def _replace_everywhere(patch: Patch, package: str, attr: str, original: Any, new: Any) -> None:
    """Replaces ``attr`` in every loaded module of ``package`` where it is ``original``."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        try:
            if module.__dict__.get(attr) is original:
                patch._replace(module, attr, new)
        except AttributeError:
            continue


def _is_safetensors_file(path: Any) -> bool:
    try:
        return os.fspath(path).endswith(".safetensors")
    except TypeError:
        return False


def _pinload_device(device: Any) -> bool:
    """Whether pinload serves loads to ``device`` itself (else the original function does)."""
    from . import InvalidArgumentError, _devices

    try:
        _devices.parse(device)
    except (InvalidArgumentError, TypeError):
        return False
    return True


def _bind(original: Callable, args: tuple, kwargs: dict) -> Optional[inspect.BoundArguments]:
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def _routed_load_state_dict(original: Callable, patch: Patch, options: Dict[str, Any], counter: str,
                            cache: Any = None) -> Callable:
    """Wraps a library's ``load_state_dict(checkpoint_file, map_location=...)`` (diffusers' and
    transformers' have that shape) so that a safetensors file goes through pinload (through
    ``cache``, a ModelCache, where given: Note [Hooks over a model cache]); anything else (a .bin
    file, a dict, a device pinload does not serve) goes to the original."""

    @functools.wraps(original)
    def load_state_dict(*args, **kwargs):
        bound = _bind(original, args, kwargs)
        if bound is not None:
            a = bound.arguments
            checkpoint = a.get("checkpoint_file")
            device = a.get("map_location", "cpu")
            if _is_safetensors_file(checkpoint) and _pinload_device(device):
                patch.count("diffusers.from_single_file" if _SINGLE_FILE.get() else counter)
                patch.count("files")
                if cache is not None:
                    patch.count("cache.get")
                    return cache.get(checkpoint, device=device)
                from .torch import load_file

                return load_file(checkpoint, device=device, **_with_model_dtype(options))
        return original(*args, **kwargs)

    load_state_dict._pinload_original = original  # type: ignore[attr-defined]
    return load_state_dict


# Note [Hooks over a model cache]
# A worker that switches between pipelines builds them again and again with from_pretrained.
# patch_diffusers(cache=c) and patch_transformers(cache=c) serve every model file that
# from_pretrained reads from the ModelCache c: the first build loads it (one parallel load, kept
# within the cache's budget), and every later build of a model with that file reads nothing and
# copies nothing on the host (the tensors are the cached ones). The model's dtype is not passed
# to the load: the cache keeps the file as stored, and from_pretrained's own cast converts where
# the model's dtype differs (with no copy where it does not). As with ModelCache.get, the tensors
# alias the cache: a model that writes its weights in place (fuse_lora) writes the cached copy,
# so unfuse before switching away, or evict the entry.

# ---- diffusers ----

# Note [dtype through the conversion]
# ``ModelMixin.from_pretrained(..., torch_dtype=D)`` loads the state dict, then casts every floating
# parameter to D (and those of the class's ``_keep_in_fp32_modules`` to float32): a second pass over
# every byte. patch_diffusers wraps from_pretrained to note D and those modules for the loads it
# makes (a context variable), and the patched load_state_dict asks pinload for D with the modules
# kept in float32 (Note [Conversion on load] in convert.h), so the cast that follows finds every
# tensor in its dtype already and copies nothing. An FP8 checkpoint written by ``pinload convert``
# is dequantised on the way. An explicit ``dtype=`` given to patch_diffusers wins.
_MODEL_DTYPE: "contextvars.ContextVar[Optional[Tuple[Any, Tuple[str, ...]]]]" = contextvars.ContextVar(
    "pinload_model_dtype", default=None)


def _with_model_dtype(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` with the dtype of the from_pretrained call in progress (Note [dtype through the
    conversion]), unless they set one."""
    noted = _MODEL_DTYPE.get()
    if noted is None or options.get("dtype") is not None:
        return options
    import torch

    dtype, keep = noted
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return options
    out = dict(options)
    out["dtype"] = dtype
    if keep:
        out["keep"] = list(keep)
        out["keep_dtype"] = torch.float32
    return out


def _noting_from_pretrained(original: Any) -> Any:
    """A from_pretrained classmethod that notes torch_dtype and _keep_in_fp32_modules for the loads
    it makes."""
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls, *args, **kwargs):
        keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))  # diffusers renames torch_dtype to dtype
        token = _MODEL_DTYPE.set((dtype, keep))
        try:
            return function(cls, *args, **kwargs)
        finally:
            _MODEL_DTYPE.reset(token)

    return classmethod(from_pretrained)


# Note [Reads through the safetensors module]
# diffusers' LoRA (``loaders.lora_base``), textual-inversion and attention-processor (``loaders.unet``)
# loaders call ``safetensors.torch.load_file`` through the module (``import safetensors``), so no
# name of theirs is the function. Replacing ``safetensors.torch.load_file`` itself would route every
# library of the process through pinload, and undo could not tell our replacement from another's.
# Instead the global ``safetensors`` of each diffusers module that holds the package is replaced by a
# view of it (a module whose ``torch`` is a view of ``safetensors.torch`` with pinload's
# ``load_file``; every other attribute is the real package's, PEP 562 ``__getattr__``). The
# IP-adapter loader imports ``safe_open`` by name: that name gets pinload's handle, as in
# transformers. Each counts under the loader's name (_LOADER_COUNTERS).
_LOADER_COUNTERS = {
    "diffusers.loaders.lora_base": "diffusers.lora",
    "diffusers.loaders.textual_inversion": "diffusers.textual_inversion",
    "diffusers.loaders.ip_adapter": "diffusers.ip_adapter",
    "diffusers.loaders.unet": "diffusers.attn_procs",
}

# Set while diffusers' load_single_file_checkpoint runs: its load_state_dict call counts as
# "diffusers.from_single_file".
_SINGLE_FILE: "contextvars.ContextVar[bool]" = contextvars.ContextVar("pinload_single_file", default=False)


def _noting_single_file(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_single_file_checkpoint(*args, **kwargs):
        token = _SINGLE_FILE.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _SINGLE_FILE.reset(token)

    load_single_file_checkpoint._pinload_original = original  # type: ignore[attr-defined]
    return load_single_file_checkpoint


def _module_view(real: types.ModuleType, **overrides: Any) -> types.ModuleType:
    """A module that is ``real`` but for ``overrides`` (Note [Reads through the safetensors module])."""
    view = types.ModuleType(real.__name__, real.__doc__)
    view.__dict__.update(overrides)
    view.__dict__["__getattr__"] = lambda name: getattr(real, name)
    view.__dict__["_pinload_view_of"] = real
    return view


def _routed_load_file(original: Callable, patch: Patch, options: Dict[str, Any], counter: str) -> Callable:
    """``safetensors.torch.load_file(filename, device="cpu")`` through pinload, for the devices it serves."""

    @functools.wraps(original)
    def load_file(filename, device="cpu"):
        if _pinload_device(device):
            from .torch import load_file as pinload_load_file

            result = pinload_load_file(filename, device=device, **options)
            patch.count(counter)
            patch.count("files")
            return result
        return original(filename, device=device)

    load_file._pinload_original = original  # type: ignore[attr-defined]
    return load_file


def _is_package_or_view(value: Any, package: Any) -> bool:
    return value is package or getattr(value, "_pinload_view_of", None) is package


def _route_module_reads(patch: Patch, options: Dict[str, Any]) -> None:
    """Note [Reads through the safetensors module], for every loaded diffusers module."""
    import safetensors
    import safetensors.torch

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("diffusers."):
            continue
        d = getattr(module, "__dict__", {})
        counter = _LOADER_COUNTERS.get(name, "diffusers." + name.rsplit(".", 1)[-1])
        current: Any = d.get("safetensors")
        if _is_package_or_view(current, safetensors):
            load_file = current.torch.load_file  # the real one, or a view's (nested patches)
            torch_view = _module_view(safetensors.torch, load_file=_routed_load_file(load_file, patch, options, counter))
            patch._replace(module, "safetensors", _module_view(safetensors, torch=torch_view))
        current = d.get("safe_open")
        if current is not None and (current is safetensors.safe_open or hasattr(current, "_pinload_original")):
            patch._replace(module, "safe_open", _routed_safe_open(current, patch, options, counter))


def patch_diffusers(*, transformers: bool = True, cache: Any = None, **options: Any) -> Patch:
    """Routes diffusers' safetensors loading (``ModelMixin.from_pretrained``, and so each model
    component of ``DiffusionPipeline.from_pretrained``; ``from_single_file``; the LoRA,
    textual-inversion, attention-processor and IP-adapter loaders) through pinload; with ``transformers``
    (the default, when it is installed) also ``patch_transformers``, for a pipeline's text
    encoders. ``options`` are pinload load options (threads, block_size, direct, progress, ...).
    A model's ``torch_dtype`` and ``_keep_in_fp32_modules`` are honoured inside the load (Note
    [dtype through the conversion]); ``dtype=`` sets one for every load instead. ``cache``, a
    ``pinload.ModelCache``: every model file is served from it, so that building a pipeline again in
    a long-lived worker reads nothing (Note [Hooks over a model cache]).

    Returns a Patch: use it as a context manager, or call ``.undo()``.
    """
    from ._options import request

    request(**options)  # check them now
    import diffusers.models.model_loading_utils as mlu

    _import_all(_DIFFUSERS_MODULES)
    patch = Patch("diffusers")
    original = mlu.load_state_dict
    replacement = _routed_load_state_dict(original, patch, options, "diffusers.load_state_dict", cache)
    try:
        _replace_everywhere(patch, "diffusers", "load_state_dict", original, replacement)
        import diffusers.models.modeling_utils as modeling_utils

        mixin = modeling_utils.ModelMixin
        patch._replace(mixin, "from_pretrained", _noting_from_pretrained(mixin.__dict__["from_pretrained"]))
        try:
            import diffusers.loaders.single_file_utils as sfu
        except Exception:  # its own dependencies missing
            pass
        else:
            single = sfu.load_single_file_checkpoint
            _replace_everywhere(patch, "diffusers", "load_single_file_checkpoint", single, _noting_single_file(single))
        _route_module_reads(patch, options)
        if transformers:
            try:
                import transformers as _  # noqa: F401
            except ImportError:
                pass
            else:
                patch._children.append(patch_transformers(cache=cache, **options))
    except BaseException:
        patch.undo()
        raise
    return patch


# ---- transformers ----


def _routed_safe_open(original: Callable, patch: Patch, options: Dict[str, Any],
                      counter: str = "transformers.safe_open", cache: Any = None) -> Callable:
    from .torch import safe_open

    class _CountingSafeOpen(safe_open):
        def _load(self):
            if cache is None:
                return super()._load()
            patch.count("cache.get")
            return cache._state_dict([self._path], self._device)

        def _loaded(self):
            patch.count("files")

    def patched_safe_open(filename, framework="pt", device="cpu", *args, **kwargs):
        if framework in ("pt", "torch", "pytorch") and not args and _pinload_device(device):
            patch.count(counter)
            kwargs.pop("backend", None)
            return _CountingSafeOpen(filename, framework=framework, device=device, **options)
        return original(filename, framework, device, *args, **kwargs)

    patched_safe_open._pinload_original = original  # type: ignore[attr-defined]
    patched_safe_open.__doc__ = original.__doc__
    return patched_safe_open


def _reads_whole_files(mu: Any, load_config: Any, files: List[Any]) -> bool:
    """Whether transformers' _load_pretrained_model would read these files whole and parse their bytes
    (its ``disable_mmap`` / hf-mount branch), rather than open them with safe_open."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():  # that branch goes through load_state_dict (patched)
            return False
    except ImportError:
        pass
    if getattr(load_config, "disable_mmap", None):
        return True
    on_mount = getattr(mu, "_is_on_hf_mount", None)
    return on_mount is not None and all(on_mount(f) for f in files)


def _routed_load_pretrained_model(mu: Any, original: Callable, patch: Patch, options: Dict[str, Any],
                                  cache: Any = None) -> Callable:
    """transformers' ``_load_pretrained_model(model, state_dict, checkpoint_files, load_config, ...)``
    whose disable_mmap branch (every file read whole, its bytes parsed) is served by one pinload load
    per file, handed in as ``state_dict``: transformers takes that dict where it would take the
    parsed bytes."""

    @functools.wraps(original)
    def _load_pretrained_model(*args, **kwargs):
        bound = _bind(original, args, kwargs)
        if bound is not None:
            a = bound.arguments
            files = a.get("checkpoint_files")
            if (a.get("state_dict") is None and files and all(_is_safetensors_file(f) for f in files)
                    and _reads_whole_files(mu, a.get("load_config"), files)):
                from .torch import load_file

                state_dict: Dict[str, Any] = {}
                for f in files:
                    state_dict.update(cache.get(f) if cache is not None else load_file(f, **options))
                    patch.count("files")
                patch.count("transformers.disable_mmap")
                a["state_dict"] = state_dict
                return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)

    return _load_pretrained_model


def patch_transformers(*, cache: Any = None, **options: Any) -> Patch:
    """Routes transformers' safetensors loading (``PreTrainedModel.from_pretrained``) through
    pinload. ``options`` are pinload load options; ``cache``, a ``pinload.ModelCache``, serves every
    file from the cache instead (Note [Hooks over a model cache]). Returns a Patch (context manager,
    ``.undo()``).
    """
    from ._options import request

    request(**options)
    import safetensors
    import transformers.modeling_utils as mu

    _import_all(_TRANSFORMERS_MODULES)
    patch = Patch("transformers")
    try:
        original_open = mu.safe_open
        _replace_everywhere(patch, "transformers", "safe_open", original_open,
                            _routed_safe_open(original_open, patch, options, cache=cache))
        if original_open is not safetensors.safe_open:  # someone patched it before us: the real one too
            _replace_everywhere(patch, "transformers", "safe_open", safetensors.safe_open,
                                _routed_safe_open(safetensors.safe_open, patch, options, cache=cache))
        original_load = mu.load_state_dict
        _replace_everywhere(patch, "transformers", "load_state_dict", original_load,
                            _routed_load_state_dict(original_load, patch, options, "transformers.load_state_dict",
                                                    cache))
        model_cls = mu.PreTrainedModel
        stored = model_cls.__dict__.get("_load_pretrained_model")
        if isinstance(stored, staticmethod):
            patch._replace(model_cls, "_load_pretrained_model",
                           staticmethod(_routed_load_pretrained_model(mu, stored.__func__, patch, options, cache)))
    except BaseException:
        patch.undo()
        raise
    return patch
