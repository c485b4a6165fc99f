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

import collections
import itertools
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _core
from ._core import InvalidArgumentError, InvalidFileError
from ._options import LoadKwargs, LoadOptions, request, size

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["LoraAdapter", "LoraFuser", "LoraKeyError", "LoraLibrary", "LoraShapeError", "LoraValueError"]

PathLike = Union[str, "os.PathLike[str]", bytes]

log = logging.getLogger("pinload.lora")


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


# ---- the library ----


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
        self._resolved: Dict[Any, List["_Entry"]] = {}
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
        from .torch import load_files_batch, safe_open

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


# ---- key layouts ----


@dataclass
class _Entry:
    """One low-rank pair resolved against a model: W[weight] += factor * (up @ down)."""

    weight: str  # the name in the fuser's flat weights
    key: str  # the adapter's own key (for errors)
    down: torch.Tensor  # [r, in] or [r, in, kh, kw]
    up: torch.Tensor  # [out, r] or [out, r, 1, 1]
    factor: float  # alpha / rank
    nonfinite: Optional[str] = None  # what of the pair holds NaN or infinity (refused unless allowed)


_KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_")
_COMFY_TE = {"clip_l": "lora_te1_", "clip_g": "lora_te2_"}
_PIPELINE_COMPONENTS = ("unet", "transformer", "prior", "text_encoder", "text_encoder_2", "text_encoder_3")


def _split_pair_key(key: str) -> Optional[Tuple[str, str]]:
    """(module, "down" | "up" | "alpha") of a LoRA key in any of the spellings, or None."""
    for suffix, kind in ((".lora_down.weight", "down"), (".lora_up.weight", "up"), (".lora_A.weight", "down"),
                         (".lora_B.weight", "up"), (".lora.down.weight", "down"), (".lora.up.weight", "up"),
                         (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
                         (".alpha", "alpha")):
        if key.endswith(suffix):
            return key[: -len(suffix)], kind
    return None


def _comfy_to_kohya(sd: Dict[str, torch.Tensor], file: str) -> Dict[str, torch.Tensor]:
    """ComfyUI's generic layout (``diffusion_model.<sgm module>.lora_up.weight``,
    ``text_encoders.clip_l.transformer.<module>...``) in kohya's names, which diffusers converts."""
    out: Dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        split = _split_pair_key(key)
        if split is None:
            raise _err(LoraKeyError, "not a LoRA key (expected .lora_up/.lora_down/.lora_A/.lora_B weights or .alpha)",
                       file=file, tensor=key)
        module, kind = split
        if module.startswith("diffusion_model."):
            name = "lora_unet_" + module[len("diffusion_model."):].replace(".", "_")
        elif module.startswith("text_encoders."):
            parts = module.split(".")
            prefix = _COMFY_TE.get(parts[1])
            if prefix is None or len(parts) < 4 or parts[2] != "transformer":
                raise _err(LoraKeyError, "unknown ComfyUI text encoder", file=file, tensor=key)
            name = prefix + "_".join(parts[3:])
        else:
            raise _err(LoraKeyError, "mixes ComfyUI and other key layouts", file=file, tensor=key)
        out[name + {"down": ".lora_down.weight", "up": ".lora_up.weight", "alpha": ".alpha"}[kind]] = t
    return out


_TOKENS = itertools.count()


class _Target:
    """What a fuser fuses into: flat name -> live tensor, and the components those names fall in."""

    def __init__(self, weights: Dict[str, torch.Tensor], components: Dict[str, str],
                 unet_config: Any, has_text_model: Dict[str, bool]) -> None:
        self.weights = weights
        self.components = components  # component -> prefix of its names in `weights` ("" or "unet/")
        self.unet_config = unet_config
        self.has_text_model = has_text_model
        self.single = len(components) == 1
        self.token = next(_TOKENS)  # what an adapter's resolved keys are cached under
        # kohya-style module names ('.' -> '_'), per component: the generic mapping ComfyUI uses too.
        self._underscored: Dict[str, Dict[str, str]] = {}

    def weight_name(self, component: str, module: str) -> Optional[str]:
        prefix = self.components.get(component)
        if prefix is None:
            return None
        stripped = module[len("text_model."):] if module.startswith("text_model.") else f"text_model.{module}"
        for m in (module, stripped):  # CLIPTextModel has no text_model. level in transformers 5
            if f"{prefix}{m}.weight" in self.weights:
                return f"{prefix}{m}.weight"
        return None

    def underscored(self, component: str, name: str) -> Optional[str]:
        prefix = self.components.get(component)
        if prefix is None:
            return None
        table = self._underscored.get(component)
        if table is None:
            table = {}
            for w in self.weights:
                if w.startswith(prefix) and w.endswith(".weight"):
                    module = w[len(prefix): -len(".weight")]
                    table[module.replace(".", "_")] = w
                    if module.startswith("text_model."):
                        table[module[len("text_model."):].replace(".", "_")] = w
            self._underscored[component] = table
        return table.get(name)


def _kohya_component(name: str) -> Tuple[str, str]:
    for prefix, component in (("lora_unet_", "unet"), ("lora_te1_", "text_encoder"), ("lora_te2_", "text_encoder_2"),
                              ("lora_te3_", "text_encoder_3"), ("lora_te_", "text_encoder")):
        if name.startswith(prefix):
            return component, name[len(prefix):]
    raise AssertionError(name)


def _denoiser(target: _Target) -> str:
    for c in ("unet", "transformer", "prior"):
        if c in target.components:
            return c
    return next(iter(target.components))


def _resolve_kohya(sd: Dict[str, torch.Tensor], file: str, target: _Target,
                   ) -> Tuple[List[Tuple[str, str, torch.Tensor, torch.Tensor, Optional[float]]], List[str]]:
    """kohya / A1111 names through diffusers' own conversion (SGM block renumbering for SDXL, then
    the kohya-to-diffusers and diffusers-to-PEFT key maps); modules it cannot place fall back to the
    generic map (the module's name with '.' as '_', as ComfyUI matches them)."""
    modules: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        split = _split_pair_key(key)
        if split is None or split[0].count(".") != 0:
            raise _err(LoraKeyError, "not a kohya LoRA key (<lora_name>.lora_down.weight, .lora_up.weight, .alpha)",
                       file=file, tensor=key)
        modules.setdefault(split[0], {})[split[1]] = t
    for name, parts in modules.items():
        for kind in ("down", "up"):
            if kind not in parts:
                raise _err(LoraKeyError, f"has no lora_{kind} weight", file=file, tensor=name)
    placed: Dict[str, Tuple[str, str]] = {}  # kohya name -> (component, module) from diffusers
    try:
        placed = _diffusers_kohya(modules, target)
    except Exception:  # noqa: BLE001 - a layout diffusers does not take: the generic map below
        placed = {}
    out: List[Tuple[str, str, torch.Tensor, torch.Tensor, Optional[float]]] = []
    skipped: List[str] = []
    for name, parts in modules.items():
        component, rest = _kohya_component(name)
        if component == "unet" and "unet" not in target.components:
            component = _denoiser(target)
        alpha = _alpha(parts["alpha"], file, f"{name}.alpha") if "alpha" in parts else None
        weight = None
        if name in placed:
            weight = target.weight_name(*placed[name])
        if weight is None:
            weight = target.underscored(component, rest)
        if weight is None:
            if component not in target.components and not target.single:
                skipped.append(name)
                continue
            if component not in target.components and component.startswith("text_encoder"):
                skipped.append(name)
                continue
            raise _err(LoraKeyError, f"names no weight of the model's {component}", file=file,
                       tensor=f"{name}.lora_down.weight")
        out.append((weight, f"{name}.lora_down.weight", parts["down"], parts["up"], alpha))
    return out, skipped


def _diffusers_kohya(modules: Dict[str, Dict[str, torch.Tensor]], target: _Target) -> Dict[str, Tuple[str, str]]:
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers,
        _maybe_map_sgm_blocks_to_diffusers,
    )
    from diffusers.utils.state_dict_utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    # Tensors are followed through the renames by identity: each down weight is a distinct object.
    sd: Dict[str, Any] = {}
    origin: Dict[int, str] = {}
    for name, parts in modules.items():
        sd[f"{name}.lora_down.weight"] = parts["down"]
        sd[f"{name}.lora_up.weight"] = parts["up"]
        origin[id(parts["down"])] = name
    if target.unet_config is not None:
        sd = _maybe_map_sgm_blocks_to_diffusers(sd, target.unet_config)
    sd, _ = _convert_non_diffusers_lora_to_diffusers(sd)
    placed: Dict[str, Tuple[str, str]] = {}
    by_component: Dict[str, Dict[str, Any]] = {}
    for key, t in sd.items():
        component, _, rest = key.partition(".")
        by_component.setdefault(component, {})[rest] = t
    for component, part in by_component.items():
        if component == "unet":
            peft = convert_unet_state_dict_to_peft(part)
        else:
            peft = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
        for key, t in peft.items():
            if key.endswith(".lora_A.weight") and id(t) in origin:
                placed[origin[id(t)]] = (component, key[: -len(".lora_A.weight")])
    return placed


def _peft_alphas(metadata: Dict[str, str], component: str) -> Optional[Dict[str, Any]]:
    """The LoraConfig fields diffusers writes into ``lora_adapter_metadata`` for ``component``."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    pre = f"{component}."
    cfg = {k[len(pre):]: v for k, v in data.items() if k.startswith(pre)}
    return cfg or None


def _pattern_value(patterns: Mapping[str, Any], module: str) -> Optional[Any]:
    try:
        from peft.utils.other import get_pattern_key  # PEFT's own matching of rank/alpha patterns
    except ImportError:  # pragma: no cover - without PEFT: exact or suffix matches
        for k, v in patterns.items():
            if module == k or module.endswith("." + k):
                return v
        return None
    if not patterns:
        return None
    key = get_pattern_key(list(patterns), module)
    return patterns.get(key) if key in patterns else None


def _resolve_peft(sd: Dict[str, torch.Tensor], file: str, target: _Target, metadata: Dict[str, str],
                  ) -> Tuple[List[Tuple[str, str, torch.Tensor, torch.Tensor, Optional[float]]], List[str]]:
    """diffusers / PEFT names (``unet.<module>.lora_A.weight``, the older ``...processor.to_q_lora.down``
    and ``lora_linear_layer`` spellings) through diffusers' own maps to PEFT's."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        head, _, rest = key.partition(".")
        if head in _PIPELINE_COMPONENTS and rest:
            groups.setdefault(head, {})[rest] = t
        else:
            groups.setdefault("", {})[key] = t
    out: List[Tuple[str, str, torch.Tensor, torch.Tensor, Optional[float]]] = []
    skipped: List[str] = []
    for component, part in groups.items():
        original = {id(t): k for k, t in part.items()}
        place = component or _denoiser(target)
        if place not in target.components:
            if component and component in ("unet", "transformer", "prior") and target.single:
                place = next(iter(target.components))
            else:
                skipped.extend(part)
                continue
        peft = _to_peft(part, text_encoder=place.startswith("text_encoder"))
        cfg = _peft_alphas(metadata, component) if component else None
        modules: Dict[str, Dict[str, torch.Tensor]] = {}
        for key, t in peft.items():
            split = _split_pair_key(key)
            if split is None:
                raise _err(LoraKeyError, "not a LoRA key", file=file, tensor=(f"{component}." if component else "")
                           + original.get(id(t), key))
            modules.setdefault(split[0], {})[split[1]] = t
        for module, parts in modules.items():
            any_t = parts.get("down", parts.get("up"))
            key = (f"{component}." if component else "") + original.get(id(any_t), module)
            for kind in ("down", "up"):
                if kind not in parts:
                    raise _err(LoraKeyError, f"has no lora_{'A' if kind == 'down' else 'B'} weight", file=file,
                               tensor=key)
            weight = target.weight_name(place, module)
            if weight is None:
                raise _err(LoraKeyError, f"names no weight of the model's {place}", file=file, tensor=key)
            alpha: Optional[float] = None
            if "alpha" in parts:
                alpha = _alpha(parts["alpha"], file, (f"{component}." if component else "") + f"{module}.alpha")
            if alpha is None and cfg is not None:
                rank = parts["up"].shape[1]
                a = _pattern_value(cfg.get("alpha_pattern") or {}, module)
                r = _pattern_value(cfg.get("rank_pattern") or {}, module)
                lora_alpha = a if a is not None else cfg.get("lora_alpha")
                r = r if r is not None else cfg.get("r", rank)
                if lora_alpha is not None:
                    for what, v in (("lora_alpha", lora_alpha), ("r", r)):
                        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                                what == "r" and v <= 0):
                            raise _err(LoraValueError, f"the metadata's {what} for this module is {v!r}: not a "
                                       f"{'positive ' if what == 'r' else ''}finite number", file=file, tensor=key)
                    alpha = float(lora_alpha) * rank / float(r)  # factor = lora_alpha / r
            out.append((weight, key, parts["down"], parts["up"], alpha))
    return out, skipped


def _alpha(t: torch.Tensor, file: str, key: str) -> float:
    """An ``.alpha`` tensor's one value."""
    if t.numel() != 1:
        raise _err(LoraShapeError, f"an alpha is one value, not a tensor of shape {list(t.shape)}", file=file,
                   tensor=key)
    if t.is_complex():
        raise _err(LoraValueError, f"an alpha is a real number, not {t.dtype}", file=file, tensor=key)
    return float(t.reshape(()).item())


def _to_peft(part: Dict[str, torch.Tensor], *, text_encoder: bool) -> Dict[str, torch.Tensor]:
    if all(".lora_A." in k or ".lora_B." in k or k.endswith(".alpha") for k in part):
        return part
    try:
        from diffusers.utils.state_dict_utils import (
            convert_state_dict_to_diffusers,
            convert_state_dict_to_peft,
            convert_unet_state_dict_to_peft,
        )
    except ImportError:  # pragma: no cover - the plain spellings are read by _split_pair_key
        return part
    if text_encoder:
        try:
            return convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
        except ValueError:
            return part
    return convert_unet_state_dict_to_peft(part)


def _resolve(adapter: LoraAdapter, target: _Target) -> List[_Entry]:
    sd = adapter.tensors
    file = adapter.path
    for key in sd:
        if "dora_scale" in key or "lora_magnitude_vector" in key:
            raise _err(LoraKeyError, "DoRA adapters are not supported", file=file, tensor=key)
    keys = list(sd)
    if not keys:
        raise _err(LoraKeyError, "the adapter has no tensors", file=file)
    if all(k.startswith(("diffusion_model.", "text_encoders.")) for k in keys):
        pairs, _ = _resolve_kohya(_comfy_to_kohya(sd, file), file, target)
    elif all(k.startswith(_KOHYA_PREFIXES) for k in keys):
        pairs, _ = _resolve_kohya(dict(sd), file, target)
    else:
        for k in keys:
            if k.startswith(_KOHYA_PREFIXES + ("diffusion_model.", "text_encoders.")):
                raise _err(LoraKeyError, "mixes kohya/ComfyUI keys with diffusers/PEFT keys", file=file, tensor=k)
        pairs, _ = _resolve_peft(sd, file, target, adapter.metadata)
    entries = []
    seen: Dict[str, str] = {}
    for weight, key, down, up, alpha in pairs:
        if weight in seen:
            raise _err(LoraKeyError, f"names the same weight {weight!r} as '{seen[weight]}'", file=file, tensor=key)
        seen[weight] = key
        w = target.weights[weight]
        _check_shapes(w, down, up, file, key, weight)
        rank = down.shape[0]
        entries.append(_Entry(weight, key, down, up, (alpha / rank) if alpha is not None else 1.0,
                              _nonfinite(down, up, alpha, key)))
    return entries


def _nonfinite(down: torch.Tensor, up: torch.Tensor, alpha: Optional[float], key: str) -> Optional[str]:
    """What of a pair holds NaN or infinity (its tensor's name and count), or None."""
    up_key = f"{key} (its up)"
    for d, u in ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight")):
        if key.endswith(d):
            up_key = key[: -len(d)] + u
    for name, t in ((key, down), (up_key, up)):
        bad = int(torch.count_nonzero(~torch.isfinite(t)))
        if bad:
            return f"'{name}' holds {bad} NaN or infinite values"
    if alpha is not None and not math.isfinite(alpha):
        return f"its alpha is {alpha}"
    return None


def _check_shapes(w: torch.Tensor, down: torch.Tensor, up: torch.Tensor, file: str, key: str, weight: str) -> None:
    def bad(why: str):
        return _err(LoraShapeError, f"{why}: down {list(down.shape)}, up {list(up.shape)}, weight {weight!r} "
                    f"{list(w.shape)}", file=file, tensor=key)

    if not (down.is_floating_point() and up.is_floating_point()):
        raise bad("the pair is not floating point")
    if down.dim() >= 1 and down.shape[0] == 0:
        raise bad("rank 0: the pair has no rows (a rank-0 adapter changes nothing and has no alpha / rank)")
    if w.dim() == 2:
        if down.dim() != 2 or up.dim() != 2:
            raise bad("a linear weight takes 2-D lora weights")
    elif w.dim() == 4:
        if down.dim() != 4 or up.dim() != 4 or up.shape[2:] != (1, 1) or down.shape[2:] != w.shape[2:]:
            raise bad("a convolution takes a [r, in, kh, kw] down and a [out, r, 1, 1] up")
    else:
        raise bad(f"a {w.dim()}-D weight takes no LoRA here")
    if up.shape[1] != down.shape[0] or up.shape[0] != w.shape[0] or down.shape[1] != w.shape[1]:
        raise bad("the shapes do not match")


# ---- the fuser ----


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
