#!/usr/bin/env python3
"""Writes what bench/pipeline_bench.py's workloads read beside the generated pipelines, once
(kept when present):

    pipeline_prepare.py single-file|lora|lm|flashpack PATHS_JSON LM_GB

single-file  the SDXL pipeline as one original-layout checkpoint (tests/python/ldm_layout.py)
lora         a rank-32 LoRA over the SDXL UNet's attention, in diffusers' format (peft's names)
lm           a Llama of about LM_GB GB in bfloat16, with config.json
Both are filled as scripts/gen_checkpoints.py fills the default models (weight-like values).
flashpack    FlashPack copies of the SDXL and FLUX pipelines' diffusers components
             (save_pretrained(use_flashpack=True)), where flashpack is installed
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import warnings

warnings.simplefilter("ignore")
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

what, paths, lm_gb = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import gen_checkpoints as gen  # noqa: E402  (the default models' weight-like values and file writer)


def write_weights(path: str, shapes: dict, dtype: str, seed: int) -> int:
    """`shapes` (name -> shape) written to `path` as scripts/gen_checkpoints.py writes the default
    models (Note [Weight-like values] there); returns the file's data bytes."""
    tensors = [gen.T(name, tuple(shape), dtype) for name, shape in shapes.items()]
    gen.write_file(path, tensors, gen.WeightValues(seed), force=True)
    return sum(t.nbytes for t in tensors)


def single_file() -> None:
    out = paths["single_file"]
    if os.path.exists(out):
        return
    import diffusers
    import ldm_layout  # tests/python

    root = paths["sdxl"]
    single = {}
    for component in ("unet", "vae", "text_encoder", "text_encoder_2"):
        sub = os.path.join(root, component)
        (weights,) = [os.path.join(sub, n) for n in os.listdir(sub) if n.endswith(".fp16.safetensors")]
        sd = load_file(weights)
        if component == "unet":
            single.update(ldm_layout.unet(sd, diffusers.UNet2DConditionModel.load_config(sub)))
        elif component == "vae":
            single.update(ldm_layout.vae(sd, diffusers.AutoencoderKL.load_config(sub)))
        elif component == "text_encoder":
            single.update(ldm_layout.clip_l(sd))
        else:
            single.update(ldm_layout.clip_g(sd))
    save_file(single, out + ".tmp")
    os.replace(out + ".tmp", out)


def lora() -> None:
    folder = paths["lora"]
    if os.path.exists(os.path.join(folder, "pytorch_lora_weights.safetensors")):
        return
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet_dir = os.path.join(paths["sdxl"], "unet")
    config = diffusers.UNet2DConditionModel.load_config(unet_dir)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(config)
    unet.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    shapes = {name: tuple(p.shape) for name, p in get_peft_model_state_dict(unet).items()}
    os.makedirs(folder, exist_ok=True)
    write_weights(os.path.join(folder, "pytorch_lora_weights.safetensors"), shapes, "F16", seed=1)


def lm() -> None:
    folder = paths["lm"]
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    import transformers

    # TinyLlama-1.1B's shape (2.2 GB in bfloat16), layers scaled to the size asked for.
    layers = max(1, round(22 * lm_gb / 2.2))
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                                      max_position_embeddings=2048, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    os.makedirs(folder, exist_ok=True)
    # Shards of at most 1 GiB, in the model's order, as the hub splits them (gen_checkpoints.greedy_shards).
    tensors = [gen.T(name, tuple(p.shape), "BF16") for name, p in model.state_dict().items()]
    shards = gen.greedy_shards(tensors, 1 << 30)
    index, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_weights(os.path.join(folder, name), {t.name: t.shape for t in shard}, "BF16", seed=2 + i)
        index.update(dict.fromkeys((t.name for t in shard), name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    config.save_pretrained(folder)


def flashpack() -> None:
    try:
        import flashpack  # noqa: F401
    except ImportError:
        return
    import diffusers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import switch_pipelines as sp

    for key in ("sdxl", "flux"):
        src = paths[key]
        if not os.path.exists(os.path.join(src, "model_index.json")):
            continue
        dst = src + "-flashpack"
        if os.path.exists(os.path.join(dst, "model_index.json")):
            if not glob.glob(os.path.join(dst, "*", "*.fp16.*")):
                continue
            shutil.rmtree(dst)  # an older copy, written with the variant in its names
        with open(os.path.join(src, "model_index.json")) as f:
            index = json.load(f)
        for component, entry in index.items():
            sub = os.path.join(src, component)
            if not isinstance(entry, list) or not os.path.isdir(sub):
                continue
            out = os.path.join(dst, component)
            if entry[0] == "diffusers" and os.path.exists(os.path.join(sub, "config.json")):
                cls = getattr(diffusers, entry[1])
                variant = "fp16" if any(n.endswith(".fp16.safetensors") for n in os.listdir(sub)) else None
                dtype = torch.float16 if variant else torch.bfloat16
                fixes = sp.CONFIG_FIXES.get((index["_class_name"], component), {})
                model = cls.from_pretrained(sub, variant=variant, torch_dtype=dtype, **fixes)
                # Saved without the variant: the worker loads a FlashPack copy with variant=None.
                model.save_pretrained(out, use_flashpack=True)
                del model
            else:
                # The other components' files, linked under their names without the variant: a
                # FlashPack copy is loaded without one (its files are model.flashpack).
                if os.path.islink(out):
                    os.unlink(out)
                os.makedirs(out, exist_ok=True)
                for name in os.listdir(sub):
                    target = os.path.join(out, name.replace(".fp16.", "."))
                    if not os.path.lexists(target):
                        os.symlink(os.path.join(sub, name), target)
        with open(os.path.join(dst, "model_index.json"), "w") as f:
            json.dump(index, f)


{"single-file": single_file, "lora": lora, "lm": lm, "flashpack": flashpack}[what]()
