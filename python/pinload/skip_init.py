"""Skip-init: build a model without initialising its weights, then load the checkpoint into it.

A model built the ordinary way allocates every parameter and runs its initialiser (kaiming,
normal, ...) only for ``load_state_dict`` to overwrite it: seconds to minutes for a large model.
Here the model is built on the meta device (shapes and dtypes only, no memory, no init), and the
checkpoint's tensors, loaded by pinload into pinned CPU memory, are *assigned* to it:

    model = empty_model(UNet2DConditionModel.from_config, config)   # on meta, no init cost
    load_into(model, "unet/diffusion_pytorch_model.safetensors", device="cuda")

``load_into`` follows the seed article's order: CPU state dict -> ``load_state_dict(assign=True)``
(the parameters become the loaded tensors, no copy) -> ``.to(device)``; never ``.to(device)``
then ``load_state_dict``, which would copy every weight twice.

Buffers the checkpoint does not hold (non-persistent ones: rotary ``inv_freq`` tables,
``position_ids``) are computed by the module's constructor, which ran on meta. ``load_into``
re-creates them on the CPU, per module that owns one, by

1. the module's own ``_init_buffers()`` method, when it has one (the explicit hook: it must
   replace the module's meta buffers with real ones, e.g. with ``register_buffer``); else
2. re-running the module's constructor with the arguments it was built with (recorded by
   ``empty_model``), with parameters kept on meta so that this costs no weight init, and taking
   the missing buffers from that fresh instance.

Limits: (2) needs the module to have been built inside ``empty_model`` from an ``nn.Module``
subclass whose ``__init__`` was defined when ``empty_model`` started, and assumes the buffer
depends only on the constructor's arguments (not on later mutation, randomness or global state).
A buffer neither way can re-create, like a parameter missing from the checkpoint with
``strict=False``, leaves a meta tensor, and ``load_into`` raises, naming it. ``load_into`` renames
no keys: the checkpoint's names must be the module's ``state_dict()`` names. While ``empty_model``
runs, ``nn.Module`` subclasses' ``__init__`` are wrapped (process-wide): build models from one
thread at a time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, TypeVar, Union

import torch
from torch import nn

__all__ = ["empty_model", "load_into", "meta_tensors"]

M = TypeVar("M", bound=nn.Module)

# module -> (args, kwargs) it was constructed with, for modules built inside empty_model.
_CTOR_ARGS: "weakref.WeakKeyDictionary[nn.Module, Tuple[tuple, dict]]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def _module_classes() -> List[type]:
    seen = {nn.Module}
    order = [nn.Module]
    stack = [nn.Module]
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if sub not in seen:
                seen.add(sub)
                order.append(sub)
                stack.append(sub)
    return order


def _recorder(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        # The first __init__ to run for an instance is its own class's: it got the real arguments.
        try:
            if self not in _CTOR_ARGS:
                _CTOR_ARGS[self] = (args, kwargs)
        except TypeError:  # not hashable or not weak-referenceable: cannot be rebuilt
            pass
        return init(self, *args, **kwargs)

    __init__._pinload_recorder = True  # type: ignore[attr-defined]
    return __init__


@contextlib.contextmanager
def _recording_constructor_args() -> Iterator[None]:
    wrapped = []
    try:
        for cls in _module_classes():
            init = cls.__dict__.get("__init__")
            if not inspect.isfunction(init) or getattr(init, "_pinload_recorder", False):
                continue
            wrapper = _recorder(init)
            try:
                type.__setattr__(cls, "__init__", wrapper)
            except (TypeError, AttributeError):
                continue
            wrapped.append((cls, init, wrapper))
        yield
    finally:
        for cls, init, wrapper in reversed(wrapped):
            if cls.__dict__.get("__init__") is wrapper:
                type.__setattr__(cls, "__init__", init)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters move to meta as they are registered (so their init costs nothing); buffers and
    everything else are created for real. The approach of accelerate's init_empty_weights."""
    original = nn.Module.register_parameter

    def register_parameter(self, name, param):
        original(self, name, param)
        if param is not None and not param.is_meta:
            p = self._parameters[name]
            try:
                self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            except TypeError:
                self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(cls_or_fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """``cls_or_fn(*args, **kwargs)`` on the meta device: no memory, no weight init.

    ``cls_or_fn`` is a module class (``LlamaForCausalLM``, with a config), a factory
    (``UNet2DConditionModel.from_config``) or any function that builds a module. The modules'
    constructor arguments are recorded so that ``load_into`` can re-create buffers that are not
    in the checkpoint.
    """
    with _LOCK, _recording_constructor_args(), torch.device("meta"):
        return cls_or_fn(*args, **kwargs)


def meta_tensors(module: nn.Module) -> List[str]:
    """Names of the parameters and buffers of ``module`` that are still on the meta device."""
    out = [n for n, p in module.named_parameters(remove_duplicate=False) if p.is_meta]
    out += [n for n, b in module.named_buffers(remove_duplicate=False) if b is not None and b.is_meta]
    return out


def _tied_groups(module: nn.Module) -> List[List[str]]:
    by_id: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _owner(module: nn.Module, name: str) -> Tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _rematerialize_buffers(module: nn.Module) -> List[str]:
    """Re-creates meta buffers (see the module docstring); returns those it could not."""
    unresolved = []
    for prefix, sub in module.named_modules():
        missing = [n for n, b in sub._buffers.items() if b is not None and b.is_meta]
        if not missing:
            continue
        hook = getattr(type(sub), "_init_buffers", None)
        if hook is not None:
            with torch.device("cpu"):
                sub._init_buffers()
        elif sub in _CTOR_ARGS:
            args, kwargs = _CTOR_ARGS[sub]
            with _LOCK, _parameters_on_meta(), torch.device("cpu"):
                fresh = type(sub)(*args, **kwargs)
            for n in missing:
                buffer = fresh._buffers.get(n)
                if buffer is not None and not buffer.is_meta:
                    sub._buffers[n] = buffer
        unresolved += [f"{prefix}.{n}" if prefix else n for n, b in sub._buffers.items() if b is not None and b.is_meta]
    return unresolved


def load_into(
    module: M,
    state_dict_or_path: Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]", List[Any]],
    device: Union[str, torch.device, None] = "cpu",
    *,
    strict: bool = True,
    dtype: Optional[torch.dtype] = None,
    **load_options: Any,
) -> M:
    """Loads a checkpoint into a module built by ``empty_model`` (or any module) and returns it.

    ``state_dict_or_path``: a state dict, or what ``pinload.load_files`` takes (a file, an index,
    a folder, a list of them), loaded into pinned CPU memory with ``load_options``. Then
    ``load_state_dict(strict=strict, assign=True)``: the parameters *are* the loaded tensors
    (with ``dtype``: floating-point tensors cast first). Tied parameters (one Parameter under
    several names) stay tied, and may be absent from the checkpoint under all but one name.
    Missing buffers are re-created (module docstring), and the module finally moves to
    ``device`` ("sim" counts as the CPU). Raises RuntimeError when a parameter or buffer is left
    on meta.
    """
    if isinstance(state_dict_or_path, Mapping):
        state_dict = dict(state_dict_or_path)
    else:
        from .torch import load_files

        state_dict = load_files(state_dict_or_path, device="cpu", **load_options)
    if dtype is not None:
        state_dict = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state_dict.items()}

    groups = _tied_groups(module)
    for names in groups:
        present = next((n for n in names if n in state_dict), None)
        if present is not None:
            for n in names:
                state_dict.setdefault(n, state_dict[present])

    module.load_state_dict(state_dict, strict=strict, assign=True)
    del state_dict
    for names in groups:  # assign=True made one Parameter per name: tie them again
        first_owner, first_leaf = _owner(module, names[0])
        param = first_owner._parameters[first_leaf]
        for n in names[1:]:
            owner, leaf = _owner(module, n)
            owner._parameters[leaf] = param

    unresolved = _rematerialize_buffers(module)
    left = meta_tensors(module)
    if left:
        shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        hint = (" (buffers: give the owning module an _init_buffers() method, or build it with empty_model)"
                if unresolved else "")
        raise RuntimeError(f"load_into: still on the meta device after loading: {shown}{hint}")

    if device is not None and str(device) not in ("cpu", "sim"):
        module.to(device)
    return module
