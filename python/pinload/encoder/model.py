"""A text encoder loaded with pinload, and its encoding semantics (shared by the server and the
client's local fallback, so that both give the same embeddings).

Note [Encoding modes]
Two ways to pad, chosen per request (``options.padding``):

- ``"max_length"`` (the default): the diffusers pipelines' way (FluxPipeline and
  StableDiffusion3Pipeline's ``_get_t5_prompt_embeds``, their CLIP encoders): every prompt is padded
  to ``max_length`` and the encoder is called **without** an attention mask, so the pad tokens are
  attended to, as the pipelines do. The result has ``max_length`` positions; ``attention_mask`` is the
  tokenizer's (1 on prompt tokens), for callers that want it.
- ``"longest"``: the prompt's own tokens only. A batch is padded to its longest prompt and the mask
  is passed to the encoder; positions past a prompt's end are zeroed, and each prompt's result is
  cut to its own length (a request of several prompts is padded with zeros to its longest).

Either way a prompt's result does not depend on what it was batched with, except for the rounding
of the matrix products at another batch shape: T5's relative position bias depends only on the
distance between positions and masked keys get exactly zero weight (the mask adds the dtype's
minimum before the softmax). tests/encoder checks batch against single within 1e-5 of the largest
magnitude (fp32).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _core

__all__ = ["Encoder", "EncodeSpec", "encoder_identity", "tokenizer_identity", "resolve_model"]

# The server tokenizes on its own threads; the tokenizers library's thread pool is not needed.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "spiece.model", "vocab.json", "merges.txt", "vocab.txt")
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class EncodeSpec:
    """What, besides the prompt, decides an embedding (part of the cache key)."""

    max_length: int
    padding: str = "max_length"  # or "longest": Note [Encoding modes]
    truncation: bool = True
    hidden_layer: Optional[int] = None  # None: the last hidden state; else hidden_states[i] (SDXL: -2)

    def key(self) -> str:
        return f"{self.max_length}|{self.padding}|{int(self.truncation)}|{self.hidden_layer}"


def resolve_model(path: str, component: Optional[str] = None, tokenizer: Optional[str] = None) -> Tuple[Path, Path]:
    """The encoder's folder and its tokenizer's folder. ``path`` is an encoder folder (tokenizer in the
    same folder unless ``tokenizer`` is given) or a diffusers pipeline folder (``model_index.json``),
    whose ``component`` (default: the T5 one, ``text_encoder_3`` for SD3, else ``text_encoder_2``) is
    served with the matching ``tokenizer*`` folder."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such encoder folder")
    if (root / "model_index.json").is_file():
        if component is None:
            index = json.loads((root / "model_index.json").read_text())
            component = "text_encoder_3" if index.get("text_encoder_3", [None])[0] else "text_encoder_2"
        model = root / component
        tok = Path(tokenizer) if tokenizer else root / component.replace("text_encoder", "tokenizer")
    else:
        model = root / component if component else root
        tok = Path(tokenizer) if tokenizer else model
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model}: no config.json (not a transformers model folder)")
    if not any((tok / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{tok}: no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...)")
    return model, tok


def _safetensors_files(model: Path) -> List[Path]:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model}: no .safetensors files")
    return files


def _header(path: Path) -> bytes:
    """The JSON header's bytes; its length is checked by pinload's own parser (_core.header_length:
    the same cap and messages as a load), an InvalidFileError (a ValueError) naming the file."""
    with open(path, "rb") as f:
        n = _core.header_length(f.read(8), os.fstat(f.fileno()).st_size, str(path))
        data = f.read(n)
        if len(data) != n:
            raise ValueError(f"{path}: header truncated ({len(data)} of {n} bytes)")
        return data


def encoder_identity(model: Path, dtype: str, state_dict: Optional[Dict[str, Any]] = None) -> str:
    """Note [Encoder identity]: sha256 over config.json, every safetensors header (names, dtypes,
    shapes, offsets, metadata) and the serving dtype; with ``state_dict``, also the first 64 bytes of
    every tensor as loaded, so that a fine-tune with the same layout (the same headers) is another
    encoder. Cheap: the headers are a few KiB and the samples are read from memory already loaded."""
    h = hashlib.sha256()
    h.update(b"config\0" + (model / "config.json").read_bytes())
    for path in _safetensors_files(model):
        h.update(b"\0file\0" + path.name.encode() + b"\0" + _header(path))
    h.update(b"\0dtype\0" + dtype.encode())
    if state_dict is not None:
        import torch

        for name in sorted(state_dict):
            t = state_dict[name]
            flat = t.detach().reshape(-1)[: max(1, 64 // max(1, t.element_size()))]
            # As bytes: numpy has no bfloat16 (nor float8) dtype.
            h.update(b"\0t\0" + name.encode() + b"\0" + flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenizer_identity(tok: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        p = tok / name
        if p.is_file():
            h.update(b"\0" + name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _model_class(config: Any):
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    by_type = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel", "mt5": "MT5EncoderModel",
               "clip_text_model": "CLIPTextModel", "clip": "CLIPTextModel"}
    name = by_type.get(getattr(config, "model_type", ""))
    if name is None:
        raise ValueError(f"cannot tell which text encoder class config model_type={config.model_type!r} needs")
    return getattr(transformers, name)


@dataclass
class Encoder:
    """A text encoder and its tokenizer, loaded with pinload (``Encoder.load``)."""

    model: Any
    tokenizer: Any
    identity: str  # Note [Encoder identity], with the tokenizer's identity
    model_identity: str
    tokenizer_identity: str
    dtype: str
    path: str
    load_path: str  # "skip_init" (empty_model + load_into) or "from_pretrained" (patched)
    load_seconds: float = 0.0
    info: Dict[str, Any] = field(default_factory=dict)
    # A fast tokenizer sets its padding and truncation state on each call, and two threads calling
    # it at once can fail ("Already borrowed", huggingface/tokenizers#537; not reproduced here with
    # tokenizers 0.23). The server checks lengths on its loop and encodes on another thread.
    _tokenizer_lock: Any = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, path: str, *, component: Optional[str] = None, tokenizer: Optional[str] = None,
             dtype: str = "fp32", device: str = "cpu", threads: int = 8) -> "Encoder":
        """Loads the encoder: built on the meta device (``pinload.skip_init.empty_model``), its weights
        loaded by pinload and assigned (``load_into``) when the checkpoint's names are the module's;
        otherwise (a checkpoint that needs transformers' key conversions) ``from_pretrained`` with
        pinload's reads (``patch_transformers``), which also builds on meta."""
        import time

        t0 = time.perf_counter()
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(sorted(DTYPES))}")
        model_dir, tok_dir = resolve_model(path, component, tokenizer)
        import torch
        from transformers import AutoConfig, AutoTokenizer

        torch_dtype = getattr(torch, DTYPES[dtype])
        config = AutoConfig.from_pretrained(str(model_dir))
        model_cls = _model_class(config)
        from .. import load_files
        from ..skip_init import empty_model, load_into

        files = [str(p) for p in _safetensors_files(model_dir)]
        state_dict = load_files(files, threads=threads)
        model = empty_model(model_cls, config)
        expected = set(model.state_dict().keys())
        tied = {n for names in _tied(model) for n in names[1:]}
        identity = encoder_identity(model_dir, DTYPES[dtype], state_dict)
        if set(state_dict) <= expected and expected - set(state_dict) <= tied | _nonpersistent(model):
            keep = _kept_in_fp32(model, torch_dtype)
            state_dict = {k: v.to(torch.float32 if k in keep else torch_dtype) if v.is_floating_point() else v
                          for k, v in state_dict.items()}
            model = load_into(model, state_dict, device=device)
            for prefix, sub in model.named_modules():  # re-created buffers, as from_pretrained has them
                for n, b in sub._buffers.items():
                    full = f"{prefix}.{n}" if prefix else n
                    if b is not None and b.is_floating_point() and full not in keep:
                        sub._buffers[n] = b.to(torch_dtype)
            how = "skip_init"
        else:
            del model, state_dict
            from ..hooks import patch_transformers

            with patch_transformers(threads=threads):
                model = model_cls.from_pretrained(str(model_dir), dtype=torch_dtype)
            model = model.to(device)
            how = "from_pretrained"
        state_dict = None
        model = model.eval().requires_grad_(False)
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        tok_id = tokenizer_identity(tok_dir)
        both = hashlib.sha256(f"{identity}|{tok_id}".encode()).hexdigest()
        return cls(model=model, tokenizer=tok, identity=both, model_identity=identity, tokenizer_identity=tok_id,
                   dtype=DTYPES[dtype], path=str(model_dir), load_path=how,
                   load_seconds=time.perf_counter() - t0,
                   info={"class": model_cls.__name__, "tokenizer": str(tok_dir),
                         "parameters": sum(p.numel() for p in model.parameters())})

    @property
    def model_max_length(self) -> int:
        n = getattr(self.tokenizer, "model_max_length", None) or 512
        limit = getattr(self.model.config, "max_position_embeddings", None)  # CLIP: 77; T5 has none
        n = min(int(n), 4096)
        return min(n, int(limit)) if limit else n

    @property
    def has_pooled(self) -> bool:
        return type(self.model).__name__.startswith("CLIP")

    def token_lengths(self, prompts: Sequence[str]) -> List[int]:
        """The number of tokens of each prompt, special tokens included, untruncated."""
        with self._tokenizer_lock:
            ids = self.tokenizer(list(prompts), padding=False, truncation=False)["input_ids"]
        return [len(x) for x in ids]

    def encode(self, prompts: Sequence[str], spec: EncodeSpec) -> List[Dict[str, Any]]:
        """Encodes ``prompts`` in one batch; returns one dict per prompt of private tensors:
        ``embeddings`` [L, d], ``attention_mask`` [L] (int64), and ``pooled`` [p] for CLIP
        (Note [Encoding modes])."""
        import torch

        longest = spec.padding == "longest"
        with self._tokenizer_lock:
            enc = self.tokenizer(list(prompts), padding="longest" if longest else "max_length",
                                 max_length=spec.max_length, truncation=spec.truncation, return_tensors="pt")
        ids = enc["input_ids"]
        mask = enc["attention_mask"].to(torch.int64)
        device = next(self.model.parameters()).device
        kwargs: Dict[str, Any] = {}
        if longest:
            kwargs["attention_mask"] = mask.to(device)
        if spec.hidden_layer is not None:
            kwargs["output_hidden_states"] = True
        with torch.inference_mode():
            out = self.model(ids.to(device), **kwargs)
        hidden = out.last_hidden_state if spec.hidden_layer is None else out.hidden_states[spec.hidden_layer]
        hidden = hidden.cpu()
        pooled = None
        if self.has_pooled:
            pooled = getattr(out, "text_embeds", None)
            if pooled is None:
                pooled = out.pooler_output
            pooled = pooled.cpu()
        results = []
        for i in range(len(prompts)):
            if longest:
                n = int(mask[i].sum())
                emb = hidden[i, :n].clone()
                m = mask[i, :n].clone()
            else:
                emb = hidden[i].clone()
                m = mask[i].clone()
            item = {"embeddings": emb, "attention_mask": m}
            if pooled is not None:
                item["pooled"] = pooled[i].clone()
            results.append(item)
        return results


def _kept_in_fp32(model: Any, torch_dtype: Any) -> set:
    """Note [Modules kept in float32]
    transformers keeps some modules of a model in float32 whatever the dtype asked for: a class's
    ``_keep_in_fp32_modules`` at float16 (T5's ``wo``, whose outputs overflow float16), its
    ``_keep_in_fp32_modules_strict`` at float16 and bfloat16. ``from_pretrained(dtype=...)``, which
    the pipelines and a local encoder use, loads those parameters as float32 and T5's feed-forward
    casts its input to ``wo``'s dtype; the skip_init path must do the same, or its embeddings
    differ from local encoding (a plain ``model.to(dtype)`` would cast ``wo`` too). The names kept
    are transformers' own plan (``_get_dtype_plan``) where it has one: patterns searched in each
    parameter name, ``*`` matching anything, as transformers' loader matches them."""
    import re

    import torch

    plan_of = getattr(model, "_get_dtype_plan", None)
    if plan_of is not None:
        patterns = [p for p, d in plan_of(torch_dtype).items() if d == torch.float32]
    else:
        patterns = list(getattr(model, "_keep_in_fp32_modules", None) or ()) if torch_dtype == torch.float16 else []
        if torch_dtype in (torch.float16, torch.bfloat16):
            patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return set()
    found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)).search
    return {name for name in model.state_dict() if found(name)}


def _tied(model: Any) -> List[List[str]]:
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _nonpersistent(model: Any) -> set:
    out = set()
    for prefix, sub in model.named_modules():
        for n in getattr(sub, "_non_persistent_buffers_set", ()):
            out.add(f"{prefix}.{n}" if prefix else n)
    return out


def stack(items: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One request's answer from its prompts' results: embeddings [n, L, d] and attention_mask
    [n, L] padded with zeros to the longest (all equal in "max_length" mode), pooled [n, p]."""
    import torch

    length = max(int(it["embeddings"].shape[0]) for it in items)
    out: Dict[str, Any] = {}
    emb = items[0]["embeddings"]
    out["embeddings"] = torch.zeros((len(items), length, emb.shape[1]), dtype=emb.dtype)
    out["attention_mask"] = torch.zeros((len(items), length), dtype=torch.int64)
    for i, it in enumerate(items):
        n = it["embeddings"].shape[0]
        out["embeddings"][i, :n] = it["embeddings"]
        out["attention_mask"][i, :n] = it["attention_mask"]
    if "pooled" in items[0]:
        out["pooled"] = torch.stack([it["pooled"] for it in items])
    return out


def nbytes(item: Dict[str, Any]) -> int:
    return sum(int(t.numel() * t.element_size()) for t in item.values()) + 256

