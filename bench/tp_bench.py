#!/usr/bin/env python3
"""4 ranks on CPU with gloo, from a cold page cache: every rank ends with every tensor of a generated
Llama-shaped checkpoint. Systems: pinload share (each rank reads ~1/4 and broadcasts), pinload with
every rank reading everything, fastsafetensors (files split across ranks, broadcast, nogds) and
Run:ai's distributed streamer (RUNAI_STREAMER_DIST=1 to allow gloo), where each imports.
Reports wall time (slowest rank, barrier to barrier) and total bytes read (sum of /proc/self/io
read_bytes over the ranks). One command:

    PYTHONPATH=build/python:python python3 bench/tp_bench.py --layers 8 --hidden 1024 --out tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "serving"))
SYSTEMS = ["pinload-share", "pinload-all", "fastsafetensors", "runai-distributed"]


def worker(system: str, ckpt: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from llama_ckpt import read_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    dist.barrier()
    before, t0 = read_bytes(), time.perf_counter()
    got = {}
    note = ""
    try:
        if system == "pinload-share":
            from pinload import distributed as pd

            got = dict(pd.iter_sharded(ckpt, mode="share", rules=[], threads=4))
        elif system == "pinload-all":
            import pinload

            got = dict(pinload.iter_tensors(files, threads=4))
        elif system == "fastsafetensors":
            from fastsafetensors import SafeTensorsFileLoader

            loader = SafeTensorsFileLoader(dist.group.WORLD, "cpu", nogds=True)
            loader.add_filenames({r: files[r::world] for r in range(world)})
            fb = loader.copy_files_to_device()
            for name in loader.get_keys():
                got[name] = fb.get_tensor(name).clone()
            fb.close()
            loader.close()
        elif system == "runai-distributed":
            os.environ.setdefault("RUNAI_STREAMER_DIST", "1")
            from runai_model_streamer import SafetensorsStreamer

            with SafetensorsStreamer() as s:
                s.stream_files(files, device="cpu", is_distributed=True)
                for name, tensor in s.get_tensors():
                    got[name] = tensor
    except Exception as e:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
        note = f"{type(e).__name__}: {e}"[:300]
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    report = {"rank": rank, "seconds_before_barrier": time.perf_counter() - t0}
    dist.barrier()
    report.update(seconds=time.perf_counter() - t0, read_bytes=read_bytes() - before, tensors=len(got),
                  tensor_bytes=nbytes, note=note)
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default="tp_bench.json")
    ap.add_argument("--worker", nargs=3, metavar=("SYSTEM", "CKPT", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    from llama_ckpt import drop_cache, write_llama

    results = {"machine": f"{os.cpu_count()} CPUs, shared with other builds (noisy)", "ranks": a.ranks, "systems": {}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        write_llama(d, shards=a.shards, layers=a.layers, hidden=a.hidden, intermediate=a.hidden * 11 // 4)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        results["checkpoint_bytes"] = size
        for system in a.systems.split(","):
            drop_cache(d)
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}",
                       os.path.abspath(__file__), "--worker", system, d, out.name]
                p = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
                if p.returncode != 0:
                    results["systems"][system] = {"error": (p.stderr or p.stdout)[-600:]}
                    continue
                ranks = json.load(open(out.name))
            notes = {r["note"] for r in ranks if r["note"]}
            results["systems"][system] = {
                "wall_s": max(r["seconds"] for r in ranks),
                "read_bytes_total": sum(r["read_bytes"] for r in ranks),
                "read_bytes_per_rank": [r["read_bytes"] for r in ranks],
                "complete": all(r["tensor_bytes"] == ranks[0]["tensor_bytes"] and r["tensors"] > 0 for r in ranks),
                "note": "; ".join(sorted(notes)),
            }
            s = results["systems"][system]
            print(f"{system:20s} wall {s['wall_s']:.2f} s  read {s['read_bytes_total'] / size:.2f} x checkpoint"
                  f"  complete={s['complete']} {s['note']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
