#!/usr/bin/env python3
"""What pinload is for, in well under a minute (scripts/demo.sh runs it on the generated FLUX and
SDXL pipelines): a service switching between models.

1. cold: each model read from storage (the page cache dropped first), safetensors' load_file
   beside pinload's, on the same files;
2. warm: the same, the files in the page cache;
3. switch: FLUX, SDXL, then back to FLUX through pinload.ModelCache: coming back reads nothing.

The page cache is dropped per file with posix_fadvise(DONTNEED) (after fsync: dirty pages are
not dropped; it drops what no other process holds mapped, and leaves other files' cache alone),
else with `echo 1 > /proc/sys/vm/drop_caches` where this process may; the line says which, or
why neither. Figures from one run on a busy machine are indicative only: docs/benchmarks.md has the
measured ones.

Usage: scripts/demo.py MODEL_FOLDER [MODEL_FOLDER...]   (each a diffusers pipeline folder)
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import sys
import time


def weight_files(folder: str) -> list:
    return sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))


def drop_cache(files: list) -> str:
    """Drops `files` from the page cache; returns how (or why not). Per file with
    posix_fadvise(DONTNEED) first (after fsync: dirty pages stay), which leaves other processes'
    cache alone; else `echo 1 > /proc/sys/vm/drop_caches` where this process may write it."""
    if hasattr(os, "posix_fadvise"):
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "dropped per file with posix_fadvise(DONTNEED)"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped: echo 1 > /proc/sys/vm/drop_caches"
    except OSError as e:
        return (f"NOT dropped (no posix_fadvise here; /proc/sys/vm/drop_caches: {e.strerror}): "
                "the 'cold' loads read from the page cache")


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    del result
    gc.collect()
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="diffusers pipeline folders (the first is switched back to)")
    a = ap.parse_args(argv)

    import safetensors.torch
    import torch  # noqa: F401  (imported before the clocks start)

    import pinload

    models = {os.path.basename(os.path.normpath(f)): weight_files(f) for f in a.folders}
    for name, files in models.items():
        if not files:
            raise SystemExit(f"demo: no .safetensors files under {name}")
    sizes = {name: sum(os.path.getsize(p) for p in files) for name, files in models.items()}
    every = [p for files in models.values() for p in files]

    def reference(files):
        return lambda: [safetensors.torch.load_file(p) for p in files]

    def ours(files):  # a model's files in one parallel sweep, one state dict each (as safetensors')
        return lambda: pinload.load_files_batch(files)

    print(f"{'model':24s} {'GB':>6s}   {'':5s} {'safetensors':>12s} {'pinload':>9s}  pinload's speed-up")
    for state in ("cold", "warm"):
        how = drop_cache(every) if state == "cold" else "the files in the page cache"
        print(f"-- {state}: {how}")
        for name, files in models.items():
            if state == "cold":
                drop_cache(files)
            ref = timed(reference(files))
            if state == "cold":
                drop_cache(files)
            mine = timed(ours(files))
            gb = sizes[name] / 1e9
            print(f"{name:24s} {gb:6.3f}   {state:5s} {ref:10.3f} s {mine:7.3f} s  {ref / mine:5.2f} x"
                  f"   ({gb / ref:5.2f} vs {gb / mine:5.2f} GB/s)")

    # A service switching models: the cache keeps the host copies, so coming back reads nothing.
    names = list(models)
    first = names[0]
    cache = pinload.ModelCache(int(sum(sizes.values()) * 1.5) + (256 << 20))
    print(f"-- switch: {' -> '.join(names + [first])} through pinload.ModelCache (first loads cold)")
    drop_cache(every)
    for name in names:
        seconds = timed(lambda: [cache.get(p) for p in models[name]])
        print(f"{name:24s} {sizes[name] / 1e9:6.3f}   load  {seconds:7.3f} s (read from storage)")
    back = timed(lambda: [cache.get(p) for p in models[first]])
    again = timed(reference(models[first]))
    stats = cache.stats()
    print(f"{first:24s} {sizes[first] / 1e9:6.3f}   back  {back:7.3f} s from the cache "
          f"(hits {stats['hits']}, misses {stats['misses']}); safetensors: {again:.3f} s, {again / back:.0f} x longer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
