"""The fuser: ``LoraFuser(model, base)`` fuses a list of ``(adapter, scale)`` into a model's weights where they
live and unfuses them by restoring from the pristine copy ``base``.

Note [Switch by recomputing from the base]
A switch never subtracts a delta: each weight the new set touches is recomputed from its pristine
copy (base + the new set's deltas, one rounding), and each weight only the old set touched is
copied back. So the result of a switch depends only on the new set, never on the history, and
``unfuse()`` (a switch to the empty set) is exact. On the CPU a weight touched by both sets is
read from the base and written once; on CUDA the base copies go host-to-device on a side stream
and each fuse waits only for its own weight's copy (restores overlap the fuses).

Note [Validate before writing]
``switch`` resolves every key of every adapter against the model (unknown key, wrong shape, rank
0, an alpha that is not one finite value, NaN or infinity in a pair unless ``allow_nonfinite``,
missing base tensor, unsupported dtype: a typed error naming the file and the key) before it
writes any weight, so a failed switch leaves the model as it was. Convolutions in any memory
format (``channels_last``) are fused through their own strides, so their layout is no failure.

Note [Atomic switches]
What the checks cannot foresee (memory running out for a product, an interrupt, a device error)
can still stop a switch midway. The fuser records each weight before it writes it, and on any
exception puts those back as the previous set had them: the ones the previous set touched are
recomputed from the base with its adapters (the same computation, so the same bits: Note [Switch
by recomputing from the base]), the others copied from the base; then the error propagates and
``active`` is the previous set. Nothing is copied aside beforehand, so a switch needs no memory for
its undo. If putting back fails too, every weight either set touched is copied from the base and
the fuser holds no adapter (the error says so).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from .._core import InvalidArgumentError
from ._errors import LoraKeyError, LoraValueError, _err
from .keys import _PIPELINE_COMPONENTS, _Entry, _resolve, _Target
from .library import LoraAdapter, LoraLibrary, PathLike

log = logging.getLogger("pinload.lora")



_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _flatten(model: Any, component: Optional[str]) -> _Target:
    """The flat weights of a model: a diffusers pipeline ("unet/<param>", "text_encoder/<param>",
    ... as ``load_files`` names a pipeline folder), a mapping of components, one module, or a state
    dict (name -> tensor, e.g. an FP8 checkpoint with its ``weight_scale`` tensors)."""
    weights: Dict[str, torch.Tensor] = {}
    components: Dict[str, str] = {}
    unet_config = None
    has_text_model: Dict[str, bool] = {}

    def add_module(name: str, module: torch.nn.Module, prefix: str) -> None:
        nonlocal unet_config
        components[name] = prefix
        for pname, t in module.state_dict(keep_vars=True).items():
            weights[prefix + pname] = t.data if isinstance(t, torch.nn.Parameter) else t
        cfg = getattr(module, "config", None)
        if name == "unet" and cfg is not None and hasattr(cfg, "layers_per_block"):
            unet_config = cfg

    if isinstance(model, torch.nn.Module):
        name = component or _guess_component(model)
        add_module(name, model, "")
    elif hasattr(model, "components") and isinstance(getattr(model, "components"), dict):  # a DiffusionPipeline
        for name, module in model.components.items():
            if isinstance(module, torch.nn.Module) and (name in _PIPELINE_COMPONENTS):
                add_module(name, module, f"{name}/")
    elif isinstance(model, Mapping) and model and all(isinstance(v, torch.nn.Module) for v in model.values()):
        for name, module in model.items():
            add_module(name, module, f"{name}/")
    elif isinstance(model, Mapping) and all(isinstance(v, torch.Tensor) for v in model.values()):
        if any("/" in k for k in model):
            for k, t in model.items():
                c, _, _ = k.partition("/")
                components.setdefault(c, f"{c}/")
                weights[k] = t
        else:
            components[component or "unet"] = ""
            weights.update(model)
    else:
        raise InvalidArgumentError("LoraFuser takes a diffusers pipeline, an nn.Module, a mapping of component names "
                                   f"to modules, or a state dict of tensors; not {type(model).__name__}")
    return _Target(weights, components, unet_config, has_text_model)


def _guess_component(module: torch.nn.Module) -> str:
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "layers_per_block"):
        return "unet"
    name = type(module).__name__
    if "TextModel" in name or "Encoder" in name:
        return "text_encoder"
    return "transformer"


@dataclass
class _Plan:
    restore: List[str] = field(default_factory=list)  # touched by the old set only
    fuse: Dict[str, List[Tuple[_Entry, float]]] = field(default_factory=dict)  # weight -> (entry, scale)


class LoraFuser:
    """Fuses LoRA adapters into ``model``'s weights in place and unfuses them by restoring from ``base``.

    ``model``: a diffusers pipeline (its ``unet`` or ``transformer`` and its text encoders), an
    ``nn.Module`` (``component`` names it: "unet", "transformer", "text_encoder"; guessed when
    None), a mapping of component name to module, or a state dict (name -> tensor; an FP8 one with
    ``<layer>.weight_scale`` tensors). ``base``: the pristine weights by the same names ("unet/<param>"
    for a pipeline, as ``pinload.load_files`` or ``ModelCache.get`` name a pipeline folder): host
    tensors in pinload's pool (pinned, for a CUDA model, with ``ModelCache(pool_device="cuda:N")``).
    None: each weight is copied to host memory (pinned for CUDA) the first time it is touched.
    ``library``: a :class:`LoraLibrary` for adapters given as paths. ``unet_config``: the UNet's
    config (or its dict), for kohya files with SGM block names fused into a state dict (a module
    brings its own). ``verify_base``: compare each
    weight with its base copy, bit for bit, the first time it is touched (once; a mismatch raises).
    ``allow_nonfinite``: fuse adapters holding NaN or infinity (refused with LoraValueError by default).

    ``switch(adapters)``, ``fuse(adapters)``, ``unfuse()``; ``adapters`` is a list of
    ``(adapter or path, scale)``. See Note [Switch by recomputing from the base].
    """

    def __init__(self, model: Any, base: Optional[Mapping[str, torch.Tensor]] = None, *,
                 library: Optional[LoraLibrary] = None, component: Optional[str] = None,
                 unet_config: Any = None, verify_base: bool = True, allow_nonfinite: bool = False,
                 chunk_bytes: int = 16 << 20) -> None:
        self._target = _flatten(model, component)
        if unet_config is not None:  # a state dict has no config: SGM block names need layers_per_block
            if isinstance(unet_config, Mapping):
                import types

                unet_config = types.SimpleNamespace(**unet_config)
            self._target.unet_config = unet_config
        self._base = base
        self._snapshots: Dict[str, torch.Tensor] = {}
        self._checked: set = set()
        self._library = library
        self._verify = verify_base
        self._allow_nonfinite = bool(allow_nonfinite)
        self._writing: List[str] = []  # the weights the switch running now may have written
        self._chunk = int(chunk_bytes)
        self._active: List[Tuple[LoraAdapter, float]] = []
        self._touched: Dict[str, List[Tuple[_Entry, float]]] = {}
        self._stream: Any = None  # torch.cuda.Stream of the base copies, made on the first CUDA switch
        self.last_switch: Dict[str, int] = {}

    @property
    def active(self) -> List[Tuple[LoraAdapter, float]]:
        """The adapters fused now, with their scales."""
        return list(self._active)

    def touched(self) -> List[str]:
        """The names of the weights that differ from the base now."""
        return list(self._touched)

    def resolve(self, adapter: Union[LoraAdapter, PathLike]) -> List[_Entry]:
        """The adapter's pairs against this model (cached per adapter and model); raises
        LoraKeyError / LoraShapeError naming the key."""
        a = self._adapter(adapter)
        key = self._target.token
        with a._lock:
            entries = a._resolved.get(key)
            if entries is None:
                entries = _resolve(a, self._target)
                a._resolved[key] = entries
        return entries

    def _adapter(self, a: Union[LoraAdapter, PathLike]) -> LoraAdapter:
        if isinstance(a, LoraAdapter):
            return a
        if self._library is None:
            raise InvalidArgumentError("an adapter given as a path needs LoraFuser(library=...)")
        return self._library.get(a)

    def fuse(self, adapters: Iterable[Tuple[Union[LoraAdapter, PathLike], float]]) -> None:
        """Adds ``adapters`` to those fused now (the touched weights are recomputed from the base)."""
        self.switch(self._active + list(adapters))

    def unfuse(self) -> None:
        """Restores every touched weight from the base: the model is bit-identical to it again."""
        self.switch([])

    def switch(self, adapters: Iterable[Tuple[Union[LoraAdapter, PathLike], float]]) -> None:
        """Moves from the adapters fused now to ``adapters``: restores the weights only the old set
        touched, recomputes those the new set touches from the base. Everything is checked first:
        a failing switch changes no weight."""
        items = [(a, float(s)) for a, s in adapters]
        for a, s in items:
            if not math.isfinite(s):
                raise InvalidArgumentError(f"the scale of {a!r} is {s}: not a finite number")
        resolved_adapters = [self._adapter(a) for a, _ in items]
        if any(a is None for a in resolved_adapters):
            raise InvalidArgumentError("an adapter could not be loaded")
        plan = _Plan()
        for adapter, (_, scale) in zip(resolved_adapters, items):
            for e in self.resolve(adapter):
                if e.nonfinite is not None and not self._allow_nonfinite:
                    raise _err(LoraValueError, f"{e.nonfinite}; LoraFuser(allow_nonfinite=True) fuses it anyway",
                               file=adapter.path, tensor=e.key)
                if scale != 0.0:
                    plan.fuse.setdefault(e.weight, []).append((e, scale))
        plan.restore = [w for w in self._touched if w not in plan.fuse]
        for w in list(plan.fuse) + plan.restore:
            self._check_weight(w)
        for w in plan.fuse:
            self._scale_of(w)  # an FP8 weight without a scale fails here, before any write
        old = self._touched
        try:
            self._run(plan)
        except BaseException as e:  # an interrupt too: the model must not be left half switched
            self._roll_back(old, e)
            raise
        self._active = list(zip(resolved_adapters, [s for _, s in items]))
        self._touched = plan.fuse
        self.last_switch = {"restored": len(plan.restore), "fused": len(plan.fuse),
                            "pairs": sum(len(v) for v in plan.fuse.values())}

    # -- checks, base copies --

    def _scale_of(self, weight: str) -> Optional[str]:
        w = self._target.weights[weight]
        if w.dtype in _FP8:
            stem = weight[: -len(".weight")]
            for name in (f"{stem}.weight_scale", f"{stem}.scale_weight"):
                if name in self._target.weights:
                    return name
            raise _err(LoraKeyError, "an FP8 weight without a weight_scale cannot be fused into", tensor=weight)
        if not w.is_floating_point():
            raise _err(LoraKeyError, f"a {w.dtype} weight cannot be fused into", tensor=weight)
        return None

    def _check_weight(self, weight: str) -> None:
        if weight in self._checked:
            return
        names = [weight]
        scale = self._scale_of(weight) if self._target.weights[weight].dtype in _FP8 else None
        if scale is not None:
            names.append(scale)
        for name in names:
            w = self._target.weights[name]
            if self._base is None:
                continue
            b = self._base.get(name)
            if b is None:
                raise _err(InvalidArgumentError, "the base has no copy of this weight", tensor=name)
            if b.shape != w.shape or b.dtype != w.dtype:
                raise _err(InvalidArgumentError, f"the base copy is {b.dtype} {list(b.shape)}, the weight "
                           f"{w.dtype} {list(w.shape)}", tensor=name)
            if b.device.type == w.device.type and _overlaps(b, w):
                raise _err(InvalidArgumentError, "the base copy is the weight's own memory (load the model with a "
                           "copy of the base, e.g. to a device, or clone the weights)", tensor=name)
            if self._verify and not _same_bits(b.to(w.device), w):
                raise _err(InvalidArgumentError, "the weight differs from its base copy", tensor=name)
        self._checked.add(weight)

    def _base_of(self, name: str) -> torch.Tensor:
        if self._base is not None:
            return self._base[name]
        snap = self._snapshots.get(name)
        if snap is None:
            w = self._target.weights[name]
            snap = torch.empty(w.shape, dtype=w.dtype, pin_memory=w.is_cuda)
            snap.copy_(w)
            self._snapshots[name] = snap
        return snap

    # -- the work --

    def _roll_back(self, old: Dict[str, List[Tuple[_Entry, float]]], error: BaseException) -> None:
        """Note [Atomic switches]: puts every weight the failed switch may have written back as it was."""
        written = list(self._writing)
        back = _Plan(fuse={w: old[w] for w in written if w in old}, restore=[w for w in written if w not in old])
        log.warning("a LoRA switch failed (%s: %s) after writing %d weights: putting them back", type(error).__name__,
                    error, len(written))
        try:
            if any(self._target.weights[w].is_cuda for w in written):
                torch.cuda.synchronize()
            self._run(back)
            if any(self._target.weights[w].is_cuda for w in written):
                torch.cuda.synchronize()
        except BaseException as again:  # noqa: BLE001 - the base at least: every weight either set touched
            log.error("putting the weights back failed too (%s: %s): restoring the base", type(again).__name__, again)
            for w in set(old) | set(written):
                self._target.weights[w].copy_(self._base_of(w))
                s = self._scale_of(w)
                if s is not None:
                    self._target.weights[s].copy_(self._base_of(s))
            self._active, self._touched = [], {}
            if isinstance(error, Exception):
                error.add_note("the model is at its base now: no adapter is fused")

    def _run(self, plan: _Plan) -> None:
        weights = self._target.weights
        names = list(plan.fuse) + plan.restore
        self._writing = []
        if self._base is None:  # snapshot every weight about to change, before the first write
            for w in plan.fuse:
                self._base_of(w)
                s = self._scale_of(w)
                if s is not None:
                    self._base_of(s)
        cuda = [n for n in names if weights[n].is_cuda]
        if cuda:
            self._writing = names  # asynchronous: any of them
            self._run_cuda(plan)
            return
        for w in plan.restore:
            self._writing.append(w)
            weights[w].copy_(self._base_of(w))
            s = self._scale_of(w)
            if s is not None:
                weights[s].copy_(self._base_of(s))
        for w, pairs in plan.fuse.items():
            self._writing.append(w)
            self._fuse_one(w, pairs, self._base_of(w))

    def _fuse_one(self, name: str, pairs: List[Tuple[_Entry, float]], base: torch.Tensor) -> None:
        """weights[name] = base + sum(scale * factor * up @ down), fp32 accumulation, in place."""
        w = self._target.weights[name]
        scale_name = self._scale_of(name)
        rows, cols = w.shape[0], math.prod(w.shape[1:])
        # A weight in another memory format (a channels_last convolution) is computed in row-major
        # order and written back through its own strides.
        flat = w.is_contiguous()
        out2 = w.view(rows, cols) if flat else None
        base2 = base.reshape(rows, cols)  # a view, or a row-major copy of a base in another format
        ups = [(e.up.reshape(e.up.shape[0], e.up.shape[1]), e.down.reshape(e.down.shape[0], cols), s * e.factor)
               for e, s in pairs]
        dev = w.device
        ups = [(u.to(dev, non_blocking=True), d.to(dev, non_blocking=True), c) for u, d, c in ups]
        if scale_name is not None:
            self._fuse_fp8(w, name, scale_name, base2, ups)
            return
        if _product_in_weight_dtype(w, ups):
            if out2 is None:
                out2 = torch.empty((rows, cols), dtype=w.dtype, device=dev)
            out2.copy_(base2)
            if len({c for _, _, c in ups}) == 1:
                u = ups[0][0] if len(ups) == 1 else torch.cat([u for u, _, _ in ups], dim=1)
                d = ups[0][1] if len(ups) == 1 else torch.cat([d for _, d, _ in ups], dim=0)
                out2.addmm_(u, d, alpha=ups[0][2])
            else:  # one product, one rounding: each adapter's coefficient goes into its down, rounded once
                u = torch.cat([u for u, _, _ in ups], dim=1)
                d = torch.cat([(d.float() * c).to(w.dtype) for _, d, c in ups], dim=0)
                out2.addmm_(u, d)
            if not flat:
                w.copy_(out2.view(w.shape))
            return
        step = rows if w.is_cuda else max(1, self._chunk // (4 * max(1, cols)))
        downs = [(u, d.float(), c) for u, d, c in ups]
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            acc = base2[r0:r1].to(dev, dtype=torch.float32, non_blocking=True, copy=True)  # never the base itself
            for u, d, c in downs:
                acc.addmm_(u[r0:r1].float(), d, alpha=c)
            w[r0:r1].copy_(acc.view((r1 - r0,) + tuple(w.shape[1:])))

    def _fuse_fp8(self, w: torch.Tensor, name: str, scale_name: str, base2: torch.Tensor,
                  ups: List[Tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """FP8: dequantise (fp8 -> fp32 times the scale), add, re-quantise with the conversion of
        docs/fp8.md (scale = amax / max per tensor or per row, 1 where amax is 0;
        fp8(clamp(x / scale, -max, max))), all on the weight's device."""
        dev = w.device
        ws = self._target.weights[scale_name]
        base_scale = self._base_of(scale_name).to(dev, non_blocking=True)
        b = base2.to(dev, non_blocking=True)
        acc = b.float() * base_scale.float().reshape(-1, 1) if base_scale.numel() > 1 else b.float() * base_scale.float()
        for u, d, c in ups:
            acc.addmm_(u.float(), d.float(), alpha=c)
        mx = _fp8_max(w.dtype)
        if ws.numel() > 1:  # per row
            amax = acc.abs().amax(dim=1, keepdim=True)
        else:
            amax = acc.abs().amax()
        new_scale = amax / mx
        new_scale = torch.where(amax == 0, torch.ones_like(new_scale), new_scale)
        q = (acc / new_scale).clamp(-mx, mx).to(w.dtype)
        w.copy_(q.view(w.shape))
        ws.copy_(new_scale.reshape(ws.shape).to(ws.dtype))

    def _run_cuda(self, plan: _Plan) -> None:
        """Base copies host-to-device on a side stream, fuses on the current stream, each fuse waiting
        for its own weight's copy: the restores of the old set overlap the new set's fuses."""
        weights = self._target.weights
        compute = torch.cuda.current_stream()
        copy = self._stream
        if copy is None:
            copy = self._stream = torch.cuda.Stream()
        copy.wait_stream(compute)  # earlier kernels that read the weights come first
        events = {}
        with torch.cuda.stream(copy):
            for w in plan.fuse:  # the fused weights' bases first: their fuses start early
                names = [w] + ([s] if (s := self._scale_of(w)) is not None else [])
                for n in names:
                    weights[n].copy_(self._base_of(n), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(copy)
                events[w] = ev
            for w in plan.restore:
                weights[w].copy_(self._base_of(w), non_blocking=True)
                s = self._scale_of(w)
                if s is not None:
                    weights[s].copy_(self._base_of(s), non_blocking=True)
        for w, pairs in plan.fuse.items():
            compute.wait_event(events[w])
            self._fuse_one(w, pairs, weights[w])  # the base is in the weight now
        compute.wait_stream(copy)  # the restores are done before anything later reads the weights

    def __repr__(self) -> str:
        return (f"<pinload.lora.LoraFuser {len(self._active)} adapters fused, {len(self._touched)} weights touched, "
                f"components {list(self._target.components)}>")


def _product_in_weight_dtype(w: torch.Tensor, ups: List[Tuple[torch.Tensor, torch.Tensor, float]]) -> bool:
    """Note [Products in the weight's dtype]
    On a CPU whose oneDNN has bf16 (fp16) kernels (AVX512-BF16, AMX; ``torch.ops.mkldnn``), a bf16
    (fp16) weight whose up and down factors share its dtype is fused as ``W.copy_(base);
    W.addmm_(up, down, alpha=c)``: oneDNN multiplies in the weight's dtype, accumulates in float32
    and adds the weight in float32 before one rounding, which is the contract of the float32 path
    (the two differ only in the order of float32 sums: about 1 element in 10^6, by one ulp) at
    2-5 x its speed. Several adapters are one product of the concatenated factors; where their
    coefficients differ, each is folded into its down factor (one more rounding of that factor,
    within the stated tolerance). Elsewhere (fp16 without kernels, mixed dtypes, float32, CUDA)
    the float32 path runs: on a CPU without these kernels a bf16 matmul is 20-60 x slower."""
    if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float16):
        return False
    if any(u.dtype != w.dtype or d.dtype != w.dtype for u, d, _ in ups):
        return False
    return _mkldnn_has(w.dtype)


_MKLDNN_KERNELS: Dict[torch.dtype, bool] = {}


def _mkldnn_has(dtype: torch.dtype) -> bool:
    known = _MKLDNN_KERNELS.get(dtype)
    if known is None:
        try:
            check = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                     else torch.ops.mkldnn._is_mkldnn_fp16_supported)
            known = bool(torch.backends.mkldnn.is_available() and check())
        except (AttributeError, RuntimeError):
            known = False
        _MKLDNN_KERNELS[dtype] = known
    return known


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN; 0.0 and -0.0 differ), whatever the memory format."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1
