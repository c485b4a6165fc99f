#!/usr/bin/env python3
"""LoRA switching: pinload.lora against diffusers' load_lora_weights + fuse_lora + unfuse_lora.

    PYTHONPATH=build/python:python python3 bench/lora_bench.py [--device cpu|cuda:0] [--ranks 32,128]
        [--adapters 10] [--switches 10] [--peer-switches 3] [--dtype bfloat16] [--config key=value ...]
        [--threads N] [--dir DIR] [--json FILE]

An SDXL-shaped UNet (diffusers' UNet2DConditionModel with SDXL base's published config, random
weights written once to DIR) and, per rank, ``--adapters`` generated kohya-layout LoRA files (SGM
block names, as SDXL LoRAs are published) targeting every attention and feed-forward linear layer
of the transformer blocks. One switch moves from one adapter to the next:

- pinload: ``LoraFuser.switch([(adapter, 1.0)])``, adapters from a ``LoraLibrary`` whose budget
  holds all of them (the first pass reads them; the switches timed are after it), the pristine
  copy in a ``ModelCache`` (host pool; pinned for CUDA);
- diffusers: ``unfuse_lora`` + ``unload_lora_weights`` of the previous adapter, then
  ``load_lora_weights`` + ``fuse_lora`` of the next (a pipeline around the same UNet; PEFT backend).

Both run on the same model in the same process, pinload first. Reported per rank: the median
switch of each, their ratio, and the floors a switch cannot beat: a copy of the touched weights'
bytes (memcpy on the CPU, device-to-device on CUDA), and the rank-r products alone (``up @ down``
for every touched weight of one adapter, into reused buffers, in the dtype pinload multiplies in
and in float32). Also: the library's bytes against its budget
and the pool memory it holds, and how far diffusers' weights drifted from the base after its
switches (pinload's are bit-identical after ``unfuse``). ``--config`` overrides UNet config keys
(``transformer_layers_per_block=[1,2,2]`` for a smaller model with SDXL's layer shapes).
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

SDXL_UNET = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "center_input_sample": False, "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True,
}  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (scripts/gen_checkpoints.py has the whole file)

LEAVES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
          "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")


def _parse_config(items) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items or []:
        key, _, text = item.partition("=")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def sgm_name(module: str, layers_per_block: int) -> str:
    """The SGM (original Stability) name of a diffusers UNet attention module, as kohya writes it."""
    parts = module.split(".")
    if parts[0] == "down_blocks":
        i, j = int(parts[1]), int(parts[3])
        head = f"input_blocks.{1 + i * (layers_per_block + 1) + j}.1"
        rest = parts[4:]
    elif parts[0] == "mid_block":
        head, rest = "middle_block.1", parts[3:]
    else:
        i, j = int(parts[1]), int(parts[3])
        head = f"output_blocks.{i * (layers_per_block + 1) + j}.1"
        rest = parts[4:]
    return ".".join([head] + rest)


def lora_targets(unet) -> List[str]:
    out = []
    for name, m in unet.named_modules():
        if ".attentions." in name and (name.endswith(LEAVES) or name.endswith((".proj_in", ".proj_out"))):
            out.append(name)
    return out


def write_model(path: str, config: Dict[str, Any], dtype) -> None:
    import torch
    import diffusers
    from safetensors.torch import save_file
    from pinload.skip_init import empty_model

    unet = empty_model(diffusers.UNet2DConditionModel.from_config, config)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, p in unet.state_dict().items():
        t = torch.empty(p.shape, dtype=torch.float32)
        t.normal_(0.0, 0.02, generator=g)
        sd[name] = t.to(dtype)
    save_file(sd, path)


def write_adapter(path: str, unet, targets: List[str], rank: int, seed: int, dtype) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    mods = dict(unet.named_modules())
    lpb = unet.config.layers_per_block
    sd = {}
    for t in targets:
        w = mods[t].weight
        name = "lora_unet_" + sgm_name(t, lpb).replace(".", "_")
        sd[f"{name}.lora_down.weight"] = (torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5).to(dtype)
        sd[f"{name}.lora_up.weight"] = (torch.randn(w.shape[0], rank, generator=g) * 0.01).to(dtype)
        sd[f"{name}.alpha"] = torch.tensor(float(rank) / 2)
    save_file(sd, path)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _products_s(entries, device: str, dtype) -> float:
    """The best of two passes of every entry's up @ down in dtype, into reused buffers."""
    import torch

    ups = [(e.up.reshape(e.up.shape[0], -1).to(device, dtype), e.down.reshape(e.down.shape[0], -1).to(device, dtype))
           for e in entries]
    outs: Dict[Any, Any] = {}
    times = []
    for _ in range(2):
        _sync(device)
        t = time.perf_counter()
        for u, d in ups:
            o = outs.get((u.shape[0], d.shape[1]))
            if o is None:
                o = outs[(u.shape[0], d.shape[1])] = torch.empty(u.shape[0], d.shape[1], device=u.device, dtype=dtype)
            torch.mm(u, d, out=o)
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ranks", default="32,128")
    ap.add_argument("--adapters", type=int, default=10)
    ap.add_argument("--switches", type=int, default=10, help="timed pinload switches per rank (after a warm pass)")
    ap.add_argument("--peer-switches", type=int, default=3, help="timed diffusers switches per rank")
    ap.add_argument("--config", nargs="*", help="UNet config overrides, key=value")
    ap.add_argument("--dir", default="/tmp/pinload-lora-bench")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--threads", type=int, help="torch intra-op threads for both (default: torch's)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import diffusers
    import pinload
    import pinload.lora as pl
    from pinload.skip_init import empty_model, load_into

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = dict(SDXL_UNET, **_parse_config(args.config))
    os.makedirs(args.dir, exist_ok=True)
    tag = json.dumps(config, sort_keys=True) + args.dtype
    import hashlib

    key = hashlib.sha1(tag.encode()).hexdigest()[:10]
    model_path = os.path.join(args.dir, f"unet-{key}.safetensors")
    if not os.path.exists(model_path):
        t = time.perf_counter()
        write_model(model_path + ".tmp", config, dtype)
        os.replace(model_path + ".tmp", model_path)
        print(f"wrote {model_path} in {time.perf_counter() - t:.1f} s", flush=True)

    device = args.device
    unet = empty_model(diffusers.UNet2DConditionModel.from_config, config)
    load_into(unet, model_path, device=device)
    if device == "cpu":  # load_into's weights alias its load's pool blocks; the base is a second copy
        pass
    params = sum(p.numel() for p in unet.parameters())
    cache = pinload.ModelCache("64G", pool_device=device if device.startswith("cuda") else "cpu")
    base = cache.get(model_path)  # the pristine copy: host pool memory (pinned for a CUDA model)
    targets = lora_targets(unet)
    touched_elems = sum(dict(unet.named_modules())[t].weight.numel() for t in targets)
    elem = torch.tensor([], dtype=dtype).element_size()
    load = os.getloadavg()
    print(f"UNet: {params / 1e9:.3f} B params {args.dtype} on {device}; {len(targets)} LoRA targets, "
          f"{touched_elems / 1e9:.3f} B elements ({touched_elems * elem / 1e9:.2f} GB) touched per adapter; "
          f"load average {load[0]:.1f}", flush=True)

    result: Dict[str, Any] = {
        "device": device, "dtype": args.dtype, "params": params, "config_overrides": _parse_config(args.config),
        "targets": len(targets), "touched_bytes": touched_elems * elem, "load_average_start": load,
        "torch": torch.__version__, "diffusers": diffusers.__version__, "threads": torch.get_num_threads(),
        "ranks": {},
    }
    try:
        import peft

        result["peft"] = peft.__version__
    except ImportError:
        args.no_peer = True

    # The floor: a copy of the touched weights' bytes (what restoring them costs).
    src = [dict(unet.named_modules())[t].weight.detach() for t in targets]
    dst = [torch.empty_like(s) for s in src]
    copies = []
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        _sync(device)
        copies.append(time.perf_counter() - t)
    del dst
    copy_s = min(copies)
    result["copy_touched_s"] = copy_s
    print(f"copy of the touched bytes: {copy_s:.3f} s ({touched_elems * elem / copy_s / 1e9:.1f} GB/s)", flush=True)

    for rank in [int(r) for r in args.ranks.split(",")]:
        paths = []
        for i in range(args.adapters):
            p = os.path.join(args.dir, f"lora-{key}-r{rank}-{i}.safetensors")
            if not os.path.exists(p):
                write_adapter(p + ".tmp", unet, targets, rank, 1000 * rank + i, dtype)
                os.replace(p + ".tmp", p)
            paths.append(p)
        adapter_bytes = sum(os.path.getsize(p) for p in paths)
        # Room for all of them: each takes a pool block of its size class, up to 1/8 above its bytes.
        budget = int(sum(pl._size_class(os.path.getsize(p)) for p in paths) * 1.02)
        in_use0 = pinload.pool_stats(device if device != "cpu" else "cpu")["in_use"]
        lib = pl.LoraLibrary(budget, device="cpu")
        fuser = pl.LoraFuser(unet, base, library=lib)
        t = time.perf_counter()
        lib.get_many(paths)  # one batch read of the 10 files
        first_read = time.perf_counter() - t
        # Warm: each adapter's keys resolved against the model (cached on the adapter), each weight's
        # base checked once (the first switch); then the timed switches.
        for p in paths:
            fuser.resolve(p)
        fuser.switch([(paths[0], 1.0)])
        _sync(device)
        misses_before = lib.stats()["misses"]
        ours = []
        for s in range(args.switches):
            p = paths[(s + 1) % len(paths)]
            t = time.perf_counter()
            fuser.switch([(p, 1.0)])
            _sync(device)
            ours.append(time.perf_counter() - t)
        timed_misses = lib.stats()["misses"] - misses_before  # adapters read again inside the timed switches
        if timed_misses:
            print(f"warning: {timed_misses} adapters were read again during the timed switches (budget too small)")
        # The floor of any fuse: the rank-r products alone (into reused buffers), one adapter, in the
        # dtype pinload multiplies in (Note [Products in the weight's dtype] in pinload/lora.py) and
        # in float32.
        entries = fuser.resolve(paths[0])
        e0 = entries[0]
        in_dtype = pl._product_in_weight_dtype(fuser._target.weights[e0.weight], [(e0.up, e0.down, 1.0)])
        product_s = _products_s(entries, device, dtype if in_dtype else torch.float32)
        product_f32_s = product_s if not in_dtype else _products_s(entries, device, torch.float32)
        fuser.unfuse()
        _sync(device)
        exact = all(torch.equal(v, base[k].to(v.device)) for k, v in unet.state_dict().items())
        in_use = pinload.pool_stats("cpu")["in_use"] - (in_use0 if device == "cpu" else 0)
        lib_stats = lib.stats()
        row: Dict[str, Any] = {
            "pinload_switch_s": ours, "pinload_median_s": statistics.median(ours), "first_batch_read_s": first_read,
            "adapter_bytes": adapter_bytes, "library": lib_stats, "bit_exact_after_unfuse": exact,
            "pool_in_use_growth": in_use, "library_misses_in_timed_switches": timed_misses, "products_s": product_s, "products_f32_s": product_f32_s,
            "products_dtype": str(dtype if in_dtype else torch.float32).replace("torch.", ""),
        }
        print(f"rank {rank}: pinload switch median {row['pinload_median_s']:.3f} s (min {min(ours):.3f}; "
              f"{row['pinload_median_s'] / copy_s:.1f} x the copy of the touched bytes, "
              f"{row['pinload_median_s'] / product_s:.2f} x the rank-{rank} products alone ({row['products_dtype']} "
              f"{product_s:.3f} s, float32 {product_f32_s:.3f} s)); "
              f"10 files read in one batch "
              f"{first_read:.3f} s; library {lib_stats['cached_bytes'] / 1e6:.1f} MB of a {budget / 1e6:.1f} MB budget, "
              f"pool growth {in_use / 1e6:.1f} MB; bit-exact after unfuse: {exact}", flush=True)
        del fuser, lib
        gc.collect()

        if not args.no_peer:
            pipe = diffusers.StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None,
                                                       tokenizer=None, tokenizer_2=None, unet=unet,
                                                       scheduler=diffusers.EulerDiscreteScheduler())
            import logging

            logging.getLogger("diffusers").setLevel(logging.ERROR)
            theirs = []
            loaded = False
            for s in range(args.peer_switches + 1):
                p = paths[s % len(paths)]
                _sync(device)
                t = time.perf_counter()
                if loaded:
                    pipe.unfuse_lora()
                    pipe.unload_lora_weights()
                pipe.load_lora_weights(p, adapter_name=f"a{s}")
                pipe.fuse_lora()
                _sync(device)
                loaded = True
                if s > 0:  # the first has no unfuse: not a switch
                    theirs.append(time.perf_counter() - t)
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
            drift = max((v.float() - base[k].to(v.device).float()).abs().max().item()
                        for k, v in unet.state_dict().items())
            changed = sum(int(not torch.equal(v, base[k].to(v.device))) for k, v in unet.state_dict().items())
            row.update(diffusers_switch_s=theirs, diffusers_median_s=statistics.median(theirs),
                       ratio=statistics.median(theirs) / row["pinload_median_s"],
                       diffusers_drift_max_abs=drift, diffusers_weights_not_restored=changed)
            print(f"rank {rank}: diffusers switch median {row['diffusers_median_s']:.3f} s -> pinload is "
                  f"{row['ratio']:.1f} x faster; after {args.peer_switches + 1} fuse/unfuse cycles diffusers left "
                  f"{changed} weights off the base (max |diff| {drift:.3g})", flush=True)
            # back to the base for the next rank
            sd = unet.state_dict()
            for k, v in sd.items():
                v.copy_(base[k])
            del pipe
            gc.collect()
        result["ranks"][str(rank)] = row
    result["load_average_end"] = os.getloadavg()
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
