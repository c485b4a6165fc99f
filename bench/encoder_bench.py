"""The text-encoder server (docs/encoder.md): throughput and latency with and without dynamic
batching, a cache hit's latency, node memory of 4 pipeline workers with a local T5 against 4 with
the server, and a worker's FLUX -> SDXL -> FLUX switch with T5 local against remote.

    PYTHONPATH=build/python:python python3 bench/encoder_bench.py [--out DIR] [--quick]

Models are generated (tests/encoder/tiny_models.py, random weights, tokenizers trained here):
- throughput: a small T5 (d_model 256, 4 layers) at max_length 77, where the encoder's per-call
  cost is what batching shares on a CPU; 16 client threads, prompts drawn from a list so that 30%
  of requests repeat an earlier prompt (answered by the cache in both modes);
- memory and switching: a T5 of T5-base's shape (d_model 768, 12 layers; 85 M parameters, 340 MB
  in fp32), next to stand-ins of the other pipeline files scaled by the real files' sizes relative
  to T5-XXL's 9.52 GB (FLUX.1-dev transformer 23.8 GB, CLIP-L 0.246, VAE 0.168; SDXL UNet 5.1,
  CLIP-G 1.39).
Every figure is from one run; the ratios are the result. ``uptime`` load is printed (the machine
is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "encoder"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_average() -> str:
    return open("/proc/loadavg").read().split()[:3].__repr__()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pinload", "encoder", "serve", "--model", str(model),
                                      "--port", str(self.port), *args], stdout=open(log, "ab"),
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        import urllib3

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}")
            try:
                if urllib3.request("GET", self.url + "/readyz", retries=False, timeout=2).status == 200:
                    return
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def make_small_t5(out: Path) -> Path:
    import tiny_models

    tiny_models.T5_SIZES.setdefault("small", dict(d_model=256, d_ff=512, num_layers=4, num_heads=4, d_kv=64))
    if not (out / "config.json").exists():
        tiny_models.make_t5(out, "small")
    return out


def make_base_t5(out: Path) -> Path:
    import tiny_models

    if not (out / "config.json").exists():
        tiny_models.make_t5(out, "base")
    return out


def prompt_stream(n: int, seed: int, repeat: float = 0.3):
    """n prompts, each an earlier one with probability ``repeat``."""
    import tiny_models

    words = " ".join(tiny_models.TEXT.split("\n")[:10]).split()
    rng = random.Random(seed)
    seen, out = [], []
    for i in range(n):
        if seen and rng.random() < repeat:
            out.append(rng.choice(seen))
        else:
            p = " ".join(rng.choice(words) for _ in range(rng.randint(6, 30))) + f" {seed}-{i}"
            seen.append(p)
            out.append(p)
    return out


def throughput(model: Path, args, tmp: Path) -> dict:
    from pinload.encoder import EncoderClient

    results = {}
    for mode, flags in (("batching", ["--max-batch", "32", "--batch-window", "5"]),
                        ("no batching", ["--max-batch", "1", "--batch-window", "0"])):
        server = Server(model, *flags, "--threads", str(args.threads), log=tmp / "server.log")
        server.wait_ready()
        client = EncoderClient(server.url, retries=0, timeout=300, pool_size=32)
        client.encode(["warm up"], max_length=77)
        streams = [prompt_stream(args.requests, seed=c) for c in range(16)]
        latencies, barrier = [], threading.Barrier(17)

        def worker(prompts):
            barrier.wait()
            for p in prompts:
                t0 = time.perf_counter()
                client.encode([p], max_length=77)
                latencies.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=worker, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        info = client.info()
        results[mode] = {"requests": len(latencies), "seconds": round(elapsed, 2),
                         "requests_per_s": round(len(latencies) / elapsed, 1),
                         "p50_ms": round(pct(latencies, 0.5) * 1e3, 1), "p99_ms": round(pct(latencies, 0.99) * 1e3, 1),
                         "cache_hits": info["cache"]["hits"], "load": load_average()}
        # a cache hit on loopback: the same prompt, one client, sequentially
        if mode == "batching":
            hit = []
            for _ in range(200):
                t0 = time.perf_counter()
                client.encode([streams[0][0]], max_length=77)
                hit.append(time.perf_counter() - t0)
            results["cache hit"] = {"p50_ms": round(pct(hit, 0.5) * 1e3, 3), "p99_ms": round(pct(hit, 0.99) * 1e3, 3),
                                    "bytes": 77 * 256 * 4}
        server.stop()
        print(json.dumps({mode: results[mode]}), flush=True)
    results["ratio"] = round(results["batching"]["requests_per_s"] / results["no batching"]["requests_per_s"], 2)
    return results


WORKER = r"""
import os, sys, time, json
mode, model, url = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
from pinload.encoder.model import Encoder, EncodeSpec
from pinload.encoder import EncoderClient
if mode == "local":
    enc = Encoder.load(model)
    emb = enc.encode(["a cat on a chair"], EncodeSpec(max_length=512))[0]["embeddings"]
else:
    emb = EncoderClient(url).encode(["a cat on a chair"], max_length=512).embeddings
print("ready", flush=True)
sys.stdin.readline()
"""


def pss_kib(pid: int) -> int:
    total = 0
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("Pss:"):
            total += int(line.split()[1])
    return total


def mem_available_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def memory(model: Path, args, tmp: Path) -> dict:
    out = {}
    server = None
    for mode in ("local", "remote"):
        url = ""
        before = mem_available_kib()
        if mode == "remote":
            server = Server(model, "--threads", str(args.threads), log=tmp / "server.log")
            server.wait_ready()
            url = server.url
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(model), url], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        workers = sum(pss_kib(p.pid) for p in procs)
        serv = pss_kib(server.proc.pid) if server is not None and mode == "remote" else 0
        node = before - mem_available_kib()
        out[mode] = {"workers_pss_mb": round(workers / 1024), "server_pss_mb": round(serv / 1024),
                     "total_pss_mb": round((workers + serv) / 1024), "node_mem_used_mb": round(node / 1024),
                     "load": load_average()}
        for p in procs:  # measured: no need to wait for their interpreters' teardown
            p.kill()
            p.wait()
        if server is not None:
            server.stop()
            server = None
        print(json.dumps({mode: out[mode]}), flush=True)
    return out


def make_standin(path: Path, nbytes: int, seed: int) -> None:
    """A safetensors file of bf16 tensors of 16 MiB (random values): the reads a pipeline switch makes."""
    if path.exists() and path.with_suffix(".done").exists():
        return
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, n, i = {}, 0, 0
    while n < nbytes:
        t = torch.randn(4096, 2048, generator=g).to(torch.bfloat16)
        tensors[f"{path.stem}.blocks.{i}.weight"] = t
        n += t.numel() * 2
        i += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    path.with_suffix(".done").touch()


SWITCH = r"""
import sys, time, json, gc
mode, t5, url, flux, sdxl, tag = sys.argv[1:7]
import torch, pinload
from pinload.encoder.model import Encoder, EncodeSpec
from pinload.encoder import EncoderClient
client = EncoderClient(url, timeout=600) if url else None
def to_flux(step):
    t0 = time.perf_counter()
    weights = pinload.load_files(flux)                         # transformer, CLIP-L, VAE stand-ins
    t1 = time.perf_counter()
    enc = Encoder.load(t5) if mode == "local" else None        # T5 with pinload (skip-init), or nothing
    t2 = time.perf_counter()
    prompt = f"a cat on a chair, {tag} {step}"                 # never cached: the server computes it
    if mode == "local":
        emb = enc.encode([prompt], EncodeSpec(max_length=512))[0]
    else:
        emb = client.encode([prompt], max_length=512).embeddings
    t3 = time.perf_counter()
    return {"weights": t1 - t0, "t5": t2 - t1, "encode": t3 - t2, "switch": t2 - t0}, (weights, enc)
def to_sdxl(step):
    t0 = time.perf_counter()
    weights = pinload.load_files(sdxl)
    return {"weights": time.perf_counter() - t0, "switch": time.perf_counter() - t0}, (weights,)
times = {}
held = None
for step, fn in (("flux", to_flux), ("sdxl", to_sdxl), ("flux again", to_flux)):
    held = None; gc.collect()
    times[step], held = fn(step)
print(json.dumps(times))
"""


def switching(t5: Path, args, tmp: Path) -> dict:
    t5_bytes = sum(p.stat().st_size for p in t5.glob("*.safetensors"))
    flux, sdxl = tmp / "flux", tmp / "sdxl"
    make_standin(flux / "transformer.safetensors", int(t5_bytes * 23.8 / 9.52), 1)  # the real sizes' ratios
    make_standin(flux / "clip_vae.safetensors", int(t5_bytes * (0.246 + 0.168) / 9.52), 2)
    make_standin(sdxl / "unet.safetensors", int(t5_bytes * 5.1 / 9.52), 3)
    make_standin(sdxl / "clip_vae.safetensors", int(t5_bytes * (0.246 + 1.39 + 0.168) / 9.52), 4)
    server = Server(t5, "--threads", str(args.threads), log=tmp / "server.log")
    server.wait_ready()
    out = {}
    for mode in ("local", "remote", "local ", "remote "):  # twice each, alternating: the page cache is warm
        r = subprocess.run([sys.executable, "-c", SWITCH, mode.strip(), str(t5), server.url if "remote" in mode else "",
                            str(flux), str(sdxl), f"{mode}{len(out.get(mode.strip(), []))}"], capture_output=True,
                           text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(r.stderr)
        times = json.loads(r.stdout.strip().splitlines()[-1])
        out.setdefault(mode.strip(), []).append({k: {p: round(x, 3) for p, x in v.items()} for k, v in times.items()})
        print(json.dumps({mode: times, "load": load_average()}), flush=True)
    server.stop()
    # "switch": the pipeline is loaded and can take prompts (T5 loaded, or the server's); "encode":
    # then one 512-token prompt (on the worker's CPU, or the server's).
    best = {m: min((r["flux again"] for r in runs), key=lambda r: r["switch"]) for m, runs in out.items()}
    out["flux_again_best"] = best
    out["ratio_switch_remote_over_local"] = round(best["remote"]["switch"] / best["local"]["switch"], 3)
    out["ratio_switch_and_encode_remote_over_local"] = round(
        (best["remote"]["switch"] + best["remote"]["encode"]) / (best["local"]["switch"] + best["local"]["encode"]), 3)
    out["bytes"] = {"t5": t5_bytes, "flux": sum(p.stat().st_size for p in flux.glob("*.safetensors")),
                    "sdxl": sum(p.stat().st_size for p in sdxl.glob("*.safetensors"))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("PINLOAD_MODELS", Path.home() / ".cache/pinload/models")) / "encoder-bench")
    ap.add_argument("--requests", type=int, default=20, help="requests per client (16 clients)")
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--only", choices=["throughput", "memory", "switch"], action="append")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["throughput", "memory", "switch"])
    report = {"cpus": os.cpu_count(), "load_start": load_average()}
    if "throughput" in only:
        report["throughput"] = throughput(make_small_t5(args.out / "t5-small"), args, args.out)
    if "memory" in only:
        report["memory"] = memory(make_base_t5(args.out / "t5-base"), args, args.out)
    if "switch" in only:
        report["switch"] = switching(make_base_t5(args.out / "t5-base"), args, args.out)
    report["load_end"] = load_average()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
