#!/usr/bin/env python3
"""Switching diffusion pipelines through pinload.ModelCache: FLUX -> SDXL -> FLUX.

A service that serves several pipelines keeps the weights of the last few in pinned host memory;
switching back to one of them reads nothing from storage and costs only the host-to-device copy
(on the CPU: nothing but assigning the cached tensors). This example uses generated weights:

  "FLUX"  the scaled-down FLUX.1-dev pipeline that `scripts/gen_checkpoints.py --scale small`
          writes to $PINLOAD_MODELS/flux-dev-small (default ~/.cache/pinload/models);
  "SDXL"  a tiny SDXL-shaped pipeline (UNet2DConditionModel with text-time embeddings, VAE, two
          CLIP text encoders) written here, with random weights, to a temporary folder.

Each switch builds the pipeline's diffusers modules (denoiser and VAE) on the meta device (no
weight init), gets the whole pipeline's weights from the cache (one parallel load on a miss,
nothing read on a hit) and assigns them (pinload.skip_init.load_into). Run from the repository root with the package importable:

  PYTHONPATH=build/python:python python3 examples/switch_pipelines.py [--device cpu|sim|cuda:0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import pinload
from pinload.skip_init import empty_model, load_into


def write_tiny_sdxl(root: str) -> str:
    """A tiny SDXL-shaped pipeline folder (diffusers layout, safetensors weights) under root."""
    import diffusers
    import transformers

    path = os.path.join(root, "sdxl-tiny")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(64, 128), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
        attention_head_dim=(2, 4), cross_attention_dim=128, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 64,  # time ids + pooled text_encoder_2 output
    )
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )
    clip = dict(vocab_size=1000, max_position_embeddings=77, num_attention_heads=4, intermediate_size=128,
                num_hidden_layers=2, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    transformers.utils.logging.disable_progress_bar()
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(hidden_size=64, **clip))
    text_encoder_2 = transformers.CLIPTextModelWithProjection(
        transformers.CLIPTextConfig(hidden_size=64, projection_dim=64, **clip))
    for name, module in [("unet", unet), ("vae", vae), ("text_encoder", text_encoder),
                         ("text_encoder_2", text_encoder_2)]:
        module.save_pretrained(os.path.join(path, name), safe_serialization=True)
    index = {"_class_name": "StableDiffusionXLPipeline",
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return path


# What the published FLUX.1-dev configs say and the generator's minimal config.json files leave
# out (the defaults differ): the guidance embedder; the VAE's four blocks, without quant convolutions.
CONFIG_FIXES = {
    ("FluxPipeline", "transformer"): {"guidance_embeds": True},
    ("FluxPipeline", "vae"): {"use_quant_conv": False, "use_post_quant_conv": False, "layers_per_block": 2,
                              "down_block_types": ["DownEncoderBlock2D"] * 4,
                              "up_block_types": ["UpDecoderBlock2D"] * 4},
}


def build_on_meta(pipeline: str) -> dict:
    """The pipeline's diffusers components (denoiser, VAE), built on the meta device from their
    config.json. The text encoders' weights are fetched with the rest but handed over as state
    dicts: the small FLUX generator writes only a minimal config.json for them."""
    import diffusers

    with open(os.path.join(pipeline, "model_index.json")) as f:
        index = json.load(f)
    modules = {}
    for component, spec in index.items():
        folder = os.path.join(pipeline, component)
        if not isinstance(spec, list) or not os.path.exists(os.path.join(folder, "config.json")):
            continue  # scheduler, tokenizers: no weights
        library, class_name = spec
        if library == "diffusers":
            cls = getattr(diffusers, class_name)
            config = {**cls.load_config(folder), **CONFIG_FIXES.get((index["_class_name"], component), {})}
            modules[component] = empty_model(cls.from_config, config)
    return modules


def match_names(module: torch.nn.Module, weights: dict) -> dict:
    """The checkpoint's names as the module names them. transformers 5 saves some models under
    their legacy names ("text_model.encoder..." for CLIPTextModel, whose modules are now
    "encoder..."): a name the module does not know loses its first segment if that makes it known."""
    known = set(module.state_dict().keys())
    out = {}
    for name, tensor in weights.items():
        if name not in known and "." in name and name.split(".", 1)[1] in known:
            name = name.split(".", 1)[1]
        out[name] = tensor
    return out


def switch_to(cache: pinload.ModelCache, name: str, pipeline: str, device: str) -> dict:
    """Builds `pipeline` on meta and fills it from the cache; prints what the switch cost."""
    hits_before = cache.stats()["hits"]
    t0 = time.perf_counter()
    modules = build_on_meta(pipeline)
    t1 = time.perf_counter()
    weights = cache.get(pipeline, device=device)  # tensors named "<component>/<name>"
    t2 = time.perf_counter()
    torch_device = "cpu" if device == "sim" else device
    for component, module in modules.items():
        prefix = component + "/"
        own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        load_into(module, match_names(module, own), device=torch_device)
    t3 = time.perf_counter()
    hit = cache.stats()["hits"] > hits_before
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"switch to {name:5s} {'HIT ' if hit else 'miss'} {size / 1e6:8.1f} MB: build on meta {t1 - t0:6.3f} s, "
          f"weights {t2 - t1:6.3f} s ({size / 1e9 / max(t2 - t1, 1e-9):6.2f} GB/s), assign {t3 - t2:6.3f} s, "
          f"total {t3 - t0:6.3f} s")
    return {"modules": modules, "hit": hit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (default), sim or cuda:N")
    ap.add_argument("--budget", default="2G", help="host-memory budget of the cache (default 2G)")
    ap.add_argument("--flux", default=os.path.join(os.environ.get("PINLOAD_MODELS", os.path.expanduser(
        "~/.cache/pinload/models")), "flux-dev-small"), help="the FLUX pipeline folder")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.flux, "model_index.json")):
        print(f"no FLUX pipeline at {args.flux}: run scripts/gen_checkpoints.py --scale small", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="pinload-switch-") as tmp:
        sdxl = write_tiny_sdxl(tmp)
        # Host copies in the device's pinned pool, so that copies to a GPU go at full speed.
        pool_device = args.device if args.device.startswith("cuda") else "cpu"
        cache = pinload.ModelCache(args.budget, pool_device=pool_device)
        reserved = None
        results = []
        for name, path in [("FLUX", args.flux), ("SDXL", sdxl), ("FLUX", args.flux)]:
            if name == "FLUX" and reserved is not None:
                reserved = pinload.pool_stats(pool_device)["os_reservations"]
            results.append(switch_to(cache, name, path, args.device))
            if reserved is None:
                reserved = pinload.pool_stats(pool_device)["os_reservations"]
        s = cache.stats()
        print(f"cache: {s['hits']} hit(s), {s['misses']} miss(es), {s['entries']} models, "
              f"{s['cached_bytes'] / 1e6:.1f} of {s['budget_bytes'] / 1e6:.1f} MB")
        new_reservations = pinload.pool_stats(pool_device)["os_reservations"] - reserved
        print(f"switching back to FLUX: {'a cache hit, nothing read from storage' if results[-1]['hit'] else 'a MISS'}"
              f", {new_reservations} new OS memory reservation(s)")
        return 0 if results[-1]["hit"] else 1


if __name__ == "__main__":
    sys.exit(main())
