"""T5 out of a FLUX or SD3 pipeline: its prompt embeddings come from ``pinload encoder serve``.

    client = EncoderClient("http://127.0.0.1:8471")
    pipe = load_pipeline("/models/flux-dev", client, dtype=torch.bfloat16)   # T5's weights never loaded here
    image = pipe("a cat on a chair", num_inference_steps=28).images[0]

Note [Remote T5 in a pipeline]
FluxPipeline and StableDiffusion3Pipeline (and their img2img, inpaint and ControlNet variants,
which share the code) make their T5 embeddings in one method, ``_get_t5_prompt_embeds(prompt,
num_images_per_prompt, max_sequence_length, device, dtype)``: pad to ``max_sequence_length``, encode
without an attention mask, cast to T5's dtype, repeat per image. ``attach`` replaces that method on
the pipeline instance with one that asks the server for the same thing ("max_length" padding: Note
[Encoding modes] in model.py), so the pipeline's own ``encode_prompt`` still runs: CLIP's pooled
(and, for SD3, its hidden-state) embeddings stay local, negative prompts and
``num_images_per_prompt`` work as before, and ``prompt_embeds=`` given by the caller still skips it.
The pipeline is loaded with ``text_encoder_2=None, tokenizer_2=None`` (``text_encoder_3`` for SD3).
Checked against diffusers 0.42; a pipeline without the method raises TypeError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from .client import EncoderClient

__all__ = ["attach", "load_pipeline", "t5_component"]


def t5_component(pipe_or_path: Any) -> str:
    """"text_encoder_3" for an SD3 pipeline (class or folder), else "text_encoder_2" (FLUX)."""
    if isinstance(pipe_or_path, (str, os.PathLike)):
        index = json.loads((Path(pipe_or_path) / "model_index.json").read_text())
        name = index.get("_class_name", "")
    else:
        name = type(pipe_or_path).__name__ if not isinstance(pipe_or_path, type) else pipe_or_path.__name__
    return "text_encoder_3" if "StableDiffusion3" in name else "text_encoder_2"


def attach(pipe: Any, client: EncoderClient, *, dtype: Any = None) -> Any:
    """Makes ``pipe`` take its T5 embeddings from ``client`` (Note [Remote T5 in a pipeline]).
    ``dtype``: cast the embeddings (default: as the server sends them, the server's T5 dtype, which
    is what the local pipeline's T5 would give). Returns ``pipe``."""
    if not callable(getattr(pipe, "_get_t5_prompt_embeds", None)):
        raise TypeError(f"{type(pipe).__name__} has no _get_t5_prompt_embeds: only FLUX- and SD3-style pipelines "
                        "take their T5 embeddings from the server")

    def _get_t5_prompt_embeds(prompt=None, num_images_per_prompt: int = 1, max_sequence_length: int = 512,
                              device=None, dtype_=None, **_: Any):
        device = device or pipe._execution_device
        prompt = [prompt] if isinstance(prompt, str) else list(prompt)
        out = client.encode(prompt, max_length=max_sequence_length, padding="max_length")
        embeds = out.embeddings.to(device=device, dtype=dtype or out.embeddings.dtype)
        batch, seq_len, _ = embeds.shape
        embeds = embeds.repeat(1, num_images_per_prompt, 1)
        return embeds.view(batch * num_images_per_prompt, seq_len, -1)

    pipe._get_t5_prompt_embeds = _get_t5_prompt_embeds
    pipe.pinload_encoder_client = client
    return pipe


def load_pipeline(path: str, client: EncoderClient, *, pipeline_class: Any = None, fallback: bool = False,
                  **kwargs: Any) -> Any:
    """``from_pretrained(path, text_encoder_N=None, tokenizer_N=None, **kwargs)`` with pinload's reads
    (``patch_diffusers``), then ``attach``. With ``fallback``, a client without a fallback of its own
    gets one: the pipeline's T5 loaded with pinload on the first call the server cannot answer."""
    from diffusers import DiffusionPipeline

    from ..hooks import patch_diffusers

    component = t5_component(path)
    tokenizer = component.replace("text_encoder", "tokenizer")
    with patch_diffusers():
        pipe = (pipeline_class or DiffusionPipeline).from_pretrained(path, **{component: None, tokenizer: None},
                                                                     **kwargs)
    if fallback and not client.has_fallback:
        client.set_fallback(_lazy_local(path, component, kwargs.get("dtype", kwargs.get("torch_dtype"))))
    return attach(pipe, client)


def _lazy_local(path: str, component: str, dtype: Optional[Any]):
    def load():
        from .model import Encoder

        name = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), "fp32")
        return Encoder.load(path, component=component, dtype=name)

    return load
