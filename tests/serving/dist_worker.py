"""One rank of the rank-aware loading tests (run by torchrun, or spawned by test_distributed.py).

Loads its share with pinload.distributed, checks every tensor against the slice of
safetensors.torch.load_file's full tensor, and writes a JSON report to <out>/rank<r>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ckpt import read_bytes  # noqa: E402

import pinload  # noqa: E402
from pinload import distributed as pd  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="slice")
    ap.add_argument("--rules", default="llama", choices=["llama", "none"])
    ap.add_argument("--batch-bytes", default="0")
    ap.add_argument("--window-bytes", default="0")
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--peer-timeout", type=float, default=20.0)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.peer_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    rules = pd.LLAMA_TP_RULES if a.rules == "llama" else []
    report = {"rank": rank, "world": world, "mismatches": []}
    # The counted window holds the load alone: a process's first collective and
    # tensor ops fault in library code, which a cold page cache reads from disk
    # and /proc/self/io would count against whichever rank ran them first.
    warm = torch.arange(1024, dtype=torch.float32)
    dist.broadcast(warm, src=0)
    warm.clone()
    dist.barrier()
    before = read_bytes()
    t0 = time.perf_counter()
    try:
        load = pd.ShardedLoad(a.ckpt, mode=a.mode, rules=rules, batch_bytes=a.batch_bytes,
                              window_bytes=a.window_bytes, peer_timeout=a.peer_timeout, threads=4)
        got = {}
        for i, (name, tensor) in enumerate(load):
            if rank == a.die_rank and i == 5:
                os._exit(3)  # dies mid-load, without a word to its peers
            got[name] = tensor.clone() if not a.no_check else tensor.shape
        report["seconds"] = time.perf_counter() - t0
        report["read_bytes"] = read_bytes() - before
        report["planned_bytes"] = load.planned_bytes
        report["pinload_bytes_read"] = load.bytes_read
        report["tensors"] = len(got)
        if not a.no_check:
            full = {}
            for f in sorted(os.listdir(a.ckpt)):
                if f.endswith(".safetensors"):
                    full.update(load_file(os.path.join(a.ckpt, f)))
            report["expected_tensors"] = len(full)
            dims = {t.name: t.dim for t in load.tensors}
            for name, want in full.items():
                want = pd.slice_of(want, dims[name], rank, world)
                have = got.get(name)
                if have is None or have.dtype != want.dtype or have.shape != want.shape or not torch.equal(have, want):
                    report["mismatches"].append(name)
    except pinload.Error as e:
        report["error"] = type(e).__name__
        report["error_message"] = str(e)
        report["seconds"] = time.perf_counter() - t0
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if "error" in report:
        os._exit(0)  # a failed group cannot be torn down cleanly; the report says what happened
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
