"""How an adapter's keys name a model's weights: kohya, ComfyUI, diffusers and PEFT layouts, resolved
and checked (shapes, rank, alpha, non-finite values) before any weight is written."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ._errors import LoraKeyError, LoraShapeError, LoraValueError, _err
from .library import LoraAdapter


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
