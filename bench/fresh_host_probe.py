#!/usr/bin/env python3
"""Fresh-process host loads, zero-copy on and off, beside safetensors (Note [Zero-copy loads]).

Every load runs in a new Python process, timed around the load call plus one touch of every 4 KiB
page of every tensor (so every byte is resident, as a user's first use makes it). Cold rounds evict
the files from the page cache first (posix_fadvise DONTNEED: only these files, not the whole
machine's cache). Systems rotate order every round; medians are printed. The fresh-memory
first-touch rate (one new process faulting in anonymous memory of the set's size) is measured in
the same rounds, as the limit of any load that copies into new memory.

    PYTHONPATH=build/python:python python3 bench/fresh_host_probe.py --gb 1.5 --rounds 3

This is a probe for the zero-copy path only; the full fresh-process scenario with every peer is
bench/fresh_bench.py (issue 16).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LOADERS = {
    "pinload": "import pinload.torch as m; sd = m.load_file(p)",
    "pinload-zero-copy-off": "import pinload.torch as m; sd = m.load_file(p, zero_copy='off')",
    "pinload-zero-copy-on": "import pinload.torch as m; sd = m.load_file(p, zero_copy='on')",
    "safetensors-mmap": "import safetensors.torch as m; sd = m.load_file(p)",
    "safetensors-pread": "import safetensors.torch as m; sd = m.load(open(p, 'rb').read())",
}

CHILD = """
import sys, time, torch
paths = sys.argv[1:]
{imports}
t0 = time.perf_counter()
total = 0
for p in paths:
    {load}
    for t in sd.values():
        b = t.reshape(-1).view(torch.uint8)
        total += int(b[::4096].sum())
dt = time.perf_counter() - t0
print(dt)
"""

TOUCH = """
import sys, time, mmap
n = int(sys.argv[1])
t0 = time.perf_counter()
m = mmap.mmap(-1, n)
for off in range(0, n, 4096):
    m[off] = 1
print(time.perf_counter() - t0)
"""


def make_set(folder, gb):
    import torch
    import safetensors.torch as st
    # A UNet-like fp16 file, a T5-like bf16 shard, a CLIP-like fp32 file (shares 5:3:2).
    shares = [("unet.safetensors", torch.float16, 0.5), ("t5.safetensors", torch.bfloat16, 0.3),
              ("clip.safetensors", torch.float32, 0.2)]
    paths = []
    g = torch.Generator().manual_seed(1)
    for name, dtype, share in shares:
        nbytes = int(gb * share * (1 << 30))
        elem = torch.tensor([], dtype=dtype).element_size()
        per = 1 << 24
        tensors = {}
        i = 0
        while nbytes > 0:
            count = min(per, nbytes) // elem
            tensors[f"layers.{i}.weight"] = torch.randint(0, 255, (count * elem,), dtype=torch.uint8,
                                                          generator=g).view(dtype)
            nbytes -= count * elem
            i += 1
        path = os.path.join(folder, name)
        st.save_file(tensors, path)
        paths.append(path)
    return paths


def evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def warm(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def run_child(loader, paths):
    code = CHILD.format(imports="", load=LOADERS[loader])
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--systems", default=",".join(LOADERS))
    args = ap.parse_args()
    systems = args.systems.split(",")
    folder = args.dir or tempfile.mkdtemp(prefix="fresh_host_")
    os.makedirs(folder, exist_ok=True)
    names = [os.path.join(folder, n) for n in ("unet.safetensors", "t5.safetensors", "clip.safetensors")]
    paths = names if all(os.path.exists(p) for p in names) and args.dir else make_set(folder, args.gb)
    total = sum(os.path.getsize(p) for p in paths)
    times = {(s, c): [] for s in systems for c in ("cold", "warm")}
    touch = []
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        out = subprocess.run([sys.executable, "-c", TOUCH, str(total)], capture_output=True, text=True, check=True)
        touch.append(float(out.stdout.strip()))
        for s in order:
            evict(paths)
            times[(s, "cold")].append(run_child(s, paths))
            warm(paths)
            times[(s, "warm")].append(run_child(s, paths))
            print(f"round {r} {s}: cold {total / times[(s, 'cold')][-1] / 1e9:.3f} GB/s, "
                  f"warm {total / times[(s, 'warm')][-1] / 1e9:.3f} GB/s", file=sys.stderr, flush=True)
    result = {"bytes": total, "rounds": args.rounds,
              "first_touch_gbps": total / statistics.median(touch) / 1e9}
    for (s, c), ts in times.items():
        result[f"{s} {c} GB/s"] = round(total / statistics.median(ts) / 1e9, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
