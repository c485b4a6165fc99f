#!/usr/bin/env python3
"""One measured request of bench/pipeline_bench.py, in a fresh process: builds a model the way a
user does (diffusers or transformers, stock or through one of the options beside it), touches one
byte of every 4 KiB page of every parameter and buffer, and prints one JSON line.

    pipeline_worker.py '{"workload": "sdxl", "system": "pinload", "paths": {...}}'

The clock starts after the imports (torch, diffusers, transformers, pinload) and stops once every
page has been touched; "build_s" is the call alone, "touch_s" the touch after it.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
import warnings

warnings.simplefilter("ignore")
spec = json.loads(sys.argv[1])
workload, system, paths = spec["workload"], spec["system"], spec["paths"]
# "device": None (host) or "cuda[:N]": the built model is moved there with .to(device), or, with
# "device_map", built there by from_pretrained(device_map=device).
device, device_map = spec.get("device"), spec.get("device_map", False)

import torch  # noqa: E402

import diffusers  # noqa: E402
import transformers  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
transformers.logging.set_verbosity_error()
try:
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
except AttributeError:
    pass

patch = None
if system.startswith("pinload"):
    import pinload  # noqa: E402

    patch = pinload.patch_diffusers()
if system == "flashpack":
    import flashpack  # noqa: E402,F401

FLASH = {"use_flashpack": True} if system == "flashpack" else {}
# What the generated FLUX VAE's minimal config.json leaves out (examples/switch_pipelines.py's
# CONFIG_FIXES; that module imports pinload, which a stock worker must not).
VAE_FIXES = {"use_quant_conv": False, "use_post_quant_conv": False, "layers_per_block": 2,
             "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}


def touch(modules) -> tuple[int, int]:
    """One byte of every 4 KiB page of every parameter and buffer: (bytes, checksum). On a GPU
    the sums run there and are read back once (a synchronisation)."""
    total, seen, sums = 0, set(), []
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if t.device.type == "meta" or t.numel() == 0 or (t.device, t.data_ptr()) in seen:
                continue
            seen.add((t.device, t.data_ptr()))
            flat = t.detach().reshape(-1).view(torch.uint8)
            sums.append(flat[::4096].sum())
            total += flat.numel()
    return total, int(sum(int(x) for x in sums))


def modules_of(obj) -> list:
    if isinstance(obj, torch.nn.Module):
        return [obj]
    if isinstance(obj, dict):
        return [m for v in obj.values() for m in modules_of(v)]
    if isinstance(obj, (list, tuple)):
        return [m for v in obj for m in modules_of(v)]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [v for v in components.values() if isinstance(v, torch.nn.Module)]
    return []


def folder(key: str) -> str:
    return paths[key + "_flashpack"] if FLASH and paths.get(key + "_flashpack") else paths[key]


PLACE = {"device_map": device} if device and device_map else {}


def placed(built):
    """The built model on `device` (moved with .to where from_pretrained did not place it)."""
    if not device or device_map:
        return built
    if isinstance(built, list):
        return [m.to(device) for m in built]
    return built.to(device)


def build():
    if workload == "sdxl":
        # A FlashPack copy has no variant (bench/pipeline_prepare.py writes model.flashpack files).
        return diffusers.StableDiffusionXLPipeline.from_pretrained(folder("sdxl"), variant=None if FLASH else "fp16",
                                                                   torch_dtype=torch.float16, **FLASH, **PLACE)
    if workload == "flux-encoders":
        root = folder("flux")
        return [transformers.CLIPTextModel.from_pretrained(os.path.join(root, "text_encoder"), dtype=torch.bfloat16),
                transformers.T5EncoderModel.from_pretrained(os.path.join(root, "text_encoder_2"), dtype=torch.bfloat16),
                diffusers.AutoencoderKL.from_pretrained(os.path.join(root, "vae"), torch_dtype=torch.bfloat16, **FLASH,
                                                        **VAE_FIXES)]
    if workload == "single-file":
        return diffusers.StableDiffusionXLPipeline.from_single_file(
            paths["single_file"], config=paths["sdxl"], local_files_only=True, torch_dtype=torch.float16)
    if workload == "lm":
        return transformers.AutoModelForCausalLM.from_pretrained(paths["lm"], dtype=torch.bfloat16)
    raise SystemExit(f"unknown workload {workload}")


out: dict = {"workload": workload, "system": system, "pid": os.getpid()}
if workload == "lora":
    # The base pipeline is built first (not timed); the request is the adapter's load.
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(paths["sdxl"], variant="fp16", torch_dtype=torch.float16)
    t0 = time.perf_counter()
    pipe.load_lora_weights(paths["lora"], adapter_name="style")
    t1 = time.perf_counter()
    lora = [p for n, p in pipe.unet.named_parameters() if "lora" in n]
    nbytes, checksum = 0, 0
    for p in lora:
        flat = p.detach().reshape(-1).view(torch.uint8)
        checksum += int(flat[::4096].sum())
        nbytes += flat.numel()
    t2 = time.perf_counter()
    out.update(build_s=t1 - t0, touch_s=t2 - t1, seconds=t2 - t0, bytes=nbytes, checksum=checksum)
elif workload == "switch":
    # A -> B -> A in one long-lived worker, each pipeline's diffusers modules (denoiser and VAE)
    # built with from_pretrained: stock (the files in the page cache by then), or inside
    # pinload.patch_diffusers(cache=ModelCache(...)). The figure is the switch back.
    fixes_of = {("FluxPipeline", "transformer"): {"guidance_embeds": True}, ("FluxPipeline", "vae"): VAE_FIXES}
    if system.startswith("pinload"):
        # from_pretrained as stock, its files served from a ModelCache (Note [Hooks over a model cache]).
        patch.undo()
        patch = pinload.patch_diffusers(cache=pinload.ModelCache(spec.get("cache_budget", "16G")))

    def switch(pipeline: str) -> dict:
        with open(os.path.join(pipeline, "model_index.json")) as f:
            index = json.load(f)
        modules = {}
        for component, entry in index.items():
            sub = os.path.join(pipeline, component)
            if not isinstance(entry, list) or entry[0] != "diffusers" or not os.path.exists(os.path.join(sub, "config.json")):
                continue
            cls = getattr(diffusers, entry[1])
            fixes = fixes_of.get((index["_class_name"], component), {})
            variant = "fp16" if any(n.endswith(".fp16.safetensors") for n in os.listdir(sub)) else None
            dtype = torch.float16 if variant else torch.bfloat16
            modules[component] = cls.from_pretrained(sub, variant=variant, torch_dtype=dtype, **fixes)
        return modules

    steps = []
    for key in ("sdxl", "flux_small", "sdxl"):
        t0 = time.perf_counter()
        got = switch(paths[key])
        nbytes, _ = touch(modules_of(got))
        steps.append({"model": key, "seconds": time.perf_counter() - t0, "bytes": nbytes})
        del got
    out.update(steps=steps, seconds=steps[-1]["seconds"], bytes=steps[-1]["bytes"])
else:
    t0 = time.perf_counter()
    built = placed(build())
    t1 = time.perf_counter()
    nbytes, checksum = touch(modules_of(built))
    t2 = time.perf_counter()
    out.update(build_s=t1 - t0, touch_s=t2 - t1, seconds=t2 - t0, bytes=nbytes, checksum=checksum)
if patch is not None:
    out["pinload_counts"] = patch.counts()
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            out["peak_rss"] = int(line.split()[1]) * 1024
print("RESULT " + json.dumps(out), flush=True)
