#!/usr/bin/env python3
"""What pinload is for, end to end (scripts/demo.sh runs it): a diffusion worker that starts,
restarts and switches, measured as the user runs it, beside stock diffusers.

1. cold start: a fresh process builds an SDXL pipeline (StableDiffusionXLPipeline.from_pretrained,
   fp16) with its files dropped from the page cache first;
2. restart: the next fresh process, the page cache as the first one left it;
3. switch: one long-lived worker goes SDXL -> FLUX -> SDXL; the switch back, stock from_pretrained
   against pinload.ModelCache.
Every row is measured in this run, in its own process (bench/pipeline_worker.py: the clock starts
after the imports and stops once one byte of every 4 KiB page of every weight has been touched).
The SDXL pipeline is full size (6.9 GB) where the models' disk has room, else the scaled-down one,
and the first line says which. Figures from one run on a busy machine are indicative only:
docs/benchmarks.md has the measured ones (bench/pipeline_bench.py).

The page cache is dropped per file with posix_fadvise(DONTNEED) (after fsync: dirty pages are
not dropped; it drops what no other process holds mapped, and leaves other files' cache alone).

Usage: scripts/demo.py [--scale auto|full|small] [--models DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "pipeline_worker.py")
FULL_SDXL_BYTES = 6_940_000_000


def weight_files(folder: str) -> list:
    return sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))


def drop_cache(files: list) -> str:
    """Drops `files` from the page cache with posix_fadvise(DONTNEED), after fsync."""
    if not hasattr(os, "posix_fadvise"):
        return "NOT dropped (no posix_fadvise here): the cold rows read from the page cache"
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "dropped per file with posix_fadvise(DONTNEED)"


def choose_scale(requested: str, models: str) -> tuple[str, str]:
    if requested != "auto":
        return requested, f"--scale {requested}"
    full = os.path.join(models, "sdxl-base", "model_index.json")
    if os.path.exists(full):
        return "full", "the full-size SDXL is already generated"
    os.makedirs(models, exist_ok=True)
    free = shutil.disk_usage(models).free
    with open("/proc/meminfo") as f:
        mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    if free >= 2 * FULL_SDXL_BYTES and mem.get("MemAvailable", 0) >= 2 * FULL_SDXL_BYTES:
        return "full", f"{free / 1e9:.0f} GB free on the models' disk"
    return "small", (f"the models' disk has {free / 1e9:.0f} GB free and {mem.get('MemAvailable', 0) / 1e9:.0f} GB of "
                     f"memory is available (the full-size SDXL wants {2 * FULL_SDXL_BYTES / 1e9:.0f} GB of each): "
                     "the scaled-down SDXL, where fixed costs weigh more than at full size")


def generate(models: str, scale: str) -> dict:
    suffix = "" if scale == "full" else "-small"
    paths = {"sdxl": os.path.join(models, "sdxl-base" + suffix), "flux_small": os.path.join(models, "flux-dev-small")}
    for only, key, gen_scale in (("sdxl", "sdxl", scale), ("flux", "flux_small", "small")):
        if not os.path.exists(os.path.join(paths[key], "model_index.json")):
            print(f"demo: generating {paths[key]} (scripts/gen_checkpoints.py --scale {gen_scale} --only {only})",
                  flush=True)
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_checkpoints.py"), "--scale", gen_scale,
                            "--out", models, "--only", only], check=True, stdout=subprocess.DEVNULL)
    return paths


def run(workload: str, system: str, paths: dict) -> dict:
    spec = json.dumps({"workload": workload, "system": system, "paths": paths})
    r = subprocess.run([sys.executable, WORKER, spec], capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"demo: the {system} worker failed:\n{r.stderr[-2000:]}")
    return json.loads(line[7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=("auto", "full", "small"), default=os.environ.get("PINLOAD_DEMO_SCALE", "auto"))
    ap.add_argument("--models", default=os.environ.get("PINLOAD_MODELS", os.path.expanduser("~/.cache/pinload/models")))
    a = ap.parse_args(argv)
    scale, why = choose_scale(a.scale, a.models)
    paths = generate(a.models, scale)
    files = [f for f in weight_files(paths["sdxl"]) if f.endswith(".fp16.safetensors")]
    size = sum(os.path.getsize(f) for f in files)
    print(f"SDXL pipeline: {paths['sdxl']} ({size / 1e9:.2f} GB of fp16 weights; {scale} size: {why})")
    print(f"{'request':34s} {'diffusers':>10s} {'pinload':>10s}  pinload's speed-up")
    how = None
    for case in ("cold start", "restart"):
        seconds = {}
        for system in ("stock", "pinload"):
            if case == "cold start":
                how = drop_cache(files)
            seconds[system] = run("sdxl", system, paths)["seconds"]
        print(f"{case:34s} {seconds['stock']:8.2f} s {seconds['pinload']:8.2f} s  {seconds['stock'] / seconds['pinload']:5.2f} x"
              + (f"   (page cache {how.split(' ')[0]})" if case == "cold start" else ""))
    switch = {s: run("switch", s, paths) for s in ("stock", "pinload")}
    stock, ours = switch["stock"]["seconds"], switch["pinload"]["seconds"]
    print(f"{'switch SDXL -> FLUX -> back to SDXL':34s} {stock:8.2f} s {ours:8.2f} s  {stock / ours:5.2f} x"
          "   (the switch back: from_pretrained again, against pinload.ModelCache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
