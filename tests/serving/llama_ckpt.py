"""A small Llama-shaped sharded checkpoint (real tensor names and layouts, random bytes) for the serving tests."""

from __future__ import annotations

import json
import os
from typing import Dict

import torch
from safetensors.torch import save_file

# A cut-down Llama: the layout of Llama-3 (GQA, gated MLP, untied lm_head) at small sizes.
TINY = dict(hidden=512, intermediate=1408, layers=4, vocab=4096, heads=8, kv_heads=2)


def llama_tensors(hidden: int, intermediate: int, layers: int, vocab: int, heads: int, kv_heads: int,
                  seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = rand(hidden)
        out[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        out[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        out[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        out[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        out[p + "post_attention_layernorm.weight"] = rand(hidden)
        out[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        out[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        out[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
    out["model.norm.weight"] = rand(hidden)
    out["lm_head.weight"] = rand(vocab, hidden)
    return out


def config_json(hidden: int, intermediate: int, layers: int, vocab: int, heads: int, kv_heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }


def write_llama(folder: str, shards: int = 2, seed: int = 0, **shape) -> str:
    """Writes model-0000i-of-0000n.safetensors, the index and config.json into `folder`; returns it.
    The files are fsync'ed, so that direct reads see them on the disk."""
    dims = dict(TINY, **shape)
    tensors = llama_tensors(seed=seed, **dims)
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        path = os.path.join(folder, file)
        save_file(part, path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json(**dims), f)
    return folder


def drop_cache(folder: str) -> None:
    """Drops the page cache of the folder's safetensors files (POSIX_FADV_DONTNEED: clean pages of
    these files only, no root needed, nothing else on the machine touched)."""
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_bytes() -> int:
    """This process's storage reads so far (/proc/self/io read_bytes: bytes fetched from the block
    layer; rchar would count page-cache hits too)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return -1
