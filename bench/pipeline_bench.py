#!/usr/bin/env python3
"""Pipelines end to end: the seed article's requests, every one in a fresh Python process.

    sudo bench/pipeline_bench.py                              # full size: SDXL 6.9 GB, a 2.2 GB LM, ...
    bench/pipeline_bench.py --scale small --rounds 1          # the small generated models (~3 min)

Workloads (generated once under --dir, default $PINLOAD_MODELS; scripts/gen_checkpoints.py's
architectures, values as it writes them):
  sdxl           StableDiffusionXLPipeline.from_pretrained(folder, variant="fp16", torch_dtype=float16)
  flux-encoders  FLUX's CLIP-L and T5 (CLIPTextModel, T5EncoderModel, bfloat16) and its VAE (AutoencoderKL)
  single-file    StableDiffusionXLPipeline.from_single_file of the SDXL pipeline written as one
                 original-layout checkpoint (tests/python/ldm_layout.py), config= the pipeline folder
  lora           pipe.load_lora_weights(file) into a built SDXL pipeline (the build not timed): a
                 rank-32 LoRA over the UNet's attention, written by peft
  lm             AutoModelForCausalLM.from_pretrained of a Llama of --lm-gb (2.2) GB in bfloat16
  switch         one long-lived worker switching SDXL -> FLUX (the small one) -> SDXL, each pipeline's
                 diffusers modules built with from_pretrained: the switch back, stock against the hooks
                 over a ModelCache (patch_diffusers(cache=...), Note [Hooks over a model cache])
Systems:
  stock          diffusers / transformers alone
  parallel       the same with HF_ENABLE_PARALLEL_LOADING=yes (diffusers' threaded loading)
  flashpack      from_pretrained(..., use_flashpack=True) of a copy saved with save_pretrained(
                 use_flashpack=True) (fal's FlashPack, from PyPI; diffusers components only)
  pinload        inside pinload.patch_diffusers()
  pinload+store  the same with PINLOAD_STORE set to a `pinload store serve` daemon of this run, with
                 transparent_hugepage/shmem_enabled at --shmem-huge-pages (default advise, as
                 docs/store.md deploys it; restored after the run)
Cases, each system in turn, the order rotated every round:
  cold           `sync; echo 3 > /proc/sys/vm/drop_caches` (root) and the store emptied, then a worker
  restart        the next fresh worker right after it (the page cache, and the store, as it left them)
Every worker touches one byte of every 4 KiB page of every parameter; its clock starts after the
imports. --device cuda moves each built model to the GPU (.to), --device-map builds it there
(from_pretrained(device_map=)); scripts/gpu-check.sh runs both on the SDXL pipeline. Limits measured in the same run on
each workload's largest file: fio's direct read and a fresh pool's first touch (pinload-bench --phases fio,pool), and
the page cache's fill rate (two readers after a drop). Ratios are against the best stock option
(stock, parallel, flashpack) of the same round; medians over the rounds.
Output: --out JSON (default bench/results/pipeline.<scale>.json) and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fresh_bench as fb  # noqa: E402
from store_bench import SHMEM_ENABLED, Daemon, shmem_enabled  # noqa: E402

STOCK = ["stock", "parallel", "flashpack"]
SYSTEMS = STOCK + ["pinload", "pinload+store"]
WORKLOADS = ["sdxl", "flux-encoders", "single-file", "lora", "lm", "switch"]


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def models_root(a) -> str:
    return a.dir or os.environ.get("PINLOAD_MODELS", os.path.expanduser("~/.cache/pinload/models"))


def generate(a) -> dict:
    """Writes what the workloads read (kept when present) and returns their paths."""
    root = models_root(a)
    suffix = "" if a.scale == "full" else "-small"
    paths = {"sdxl": os.path.join(root, "sdxl-base" + suffix), "flux": os.path.join(root, "flux-dev" + suffix),
             "flux_small": os.path.join(root, "flux-dev-small")}
    # FLUX's text encoders and VAE (at full size, not its 24 GB transformer: flux-encoders reads none of it);
    # the switch's second pipeline is the small FLUX, whatever the scale (its figure is the switch back).
    jobs = [("sdxl", "sdxl", a.scale, "unet"), ("clip-l,t5-xxl,vae", "flux", a.scale, "text_encoder_2"),
            ("flux", "flux_small", "small", "transformer")]
    for only, key, scale, probe in jobs:
        if not os.path.isdir(os.path.join(paths[key], probe)):
            log(f"pipeline_bench: generating {paths[key]} ({only})")
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_checkpoints.py"), "--scale", scale,
                            "--out", root, "--only", only], check=True, stdout=subprocess.DEVNULL)
    extra = os.path.join(root, f"pipeline-bench-{a.scale}")
    os.makedirs(extra, exist_ok=True)
    paths["single_file"] = os.path.join(extra, "sdxl-single.safetensors")
    paths["lora"] = os.path.join(extra, "sdxl-lora")
    paths["lm"] = os.path.join(extra, f"llama-{a.lm_gb:g}gb")
    script = os.path.join(HERE, "pipeline_prepare.py")
    for what in ("single-file", "lora", "lm", "flashpack"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "python"),
                                                             os.path.join(ROOT, a.build, "python"),
                                                             os.path.join(ROOT, "python"),
                                                             os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, script, what, json.dumps(paths), str(a.lm_gb)], check=True, env=env)
    for key in ("sdxl", "flux"):
        fp = paths[key] + "-flashpack"
        if os.path.exists(os.path.join(fp, "model_index.json")):
            paths[key + "_flashpack"] = fp
    return paths


def files_of(workload: str, paths: dict) -> list[str]:
    if workload in ("sdxl", "lora"):
        files = glob.glob(os.path.join(paths["sdxl"], "*", "*.fp16.safetensors"))
        if workload == "lora":
            files = glob.glob(os.path.join(paths["lora"], "*.safetensors"))
        return sorted(files)
    if workload == "flux-encoders":
        return sorted(f for c in ("text_encoder", "text_encoder_2", "vae")
                      for f in glob.glob(os.path.join(paths["flux"], c, "*.safetensors")))
    if workload == "single-file":
        return [paths["single_file"]]
    if workload == "lm":
        return sorted(glob.glob(os.path.join(paths["lm"], "*.safetensors")))
    return []


def page_cache_fill(path: str, threads: int = 2, chunk: int = 16 << 20) -> float:
    """GB/s of filling the page cache with `path` after a drop: `threads` readers of `chunk`-sized
    preads into buffers they reuse. Where a cold load that keeps its file cached lands (the page
    cache, filled by the disk's DMA), beside the first touch of fresh memory (where a copy lands)."""
    import threading
    drop_caches()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()

        def read(first: int) -> None:
            buf = bytearray(chunk)
            for at in range(first * chunk, size, threads * chunk):
                os.preadv(fd, [buf], at)

        workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def drop_caches() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:
        return f"not dropped ({e.strerror})"


def run_worker(workload: str, system: str, paths: dict, env: dict, timeout: int, device: str | None = None,
               device_map: bool = False) -> dict:
    spec = {"workload": workload, "system": system, "paths": paths, "device": device, "device_map": device_map}
    run_env = dict(env)
    if system == "parallel":
        run_env["HF_ENABLE_PARALLEL_LOADING"] = "yes"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, os.path.join(HERE, "pipeline_worker.py"), json.dumps(spec)],
                       capture_output=True, text=True, env=run_env, timeout=timeout)
    wall = time.perf_counter() - t0
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        return {"error": (r.stderr or r.stdout)[-800:], "rc": r.returncode}
    out = json.loads(line[7:])
    out["process_s"] = wall
    return out


def supported(workload: str, system: str, paths: dict) -> str | None:
    """Why a system does not run a workload, or None."""
    if system == "flashpack":
        if workload == "sdxl" and "sdxl_flashpack" not in paths:
            return "no FlashPack copy (flashpack not installed?)"
        if workload in ("single-file", "lora", "lm", "switch"):
            return "FlashPack reads only diffusers from_pretrained copies"
        if workload == "flux-encoders" and "flux_flashpack" not in paths:
            return "no FlashPack copy"
    if workload == "switch" and system in ("parallel", "flashpack", "pinload+store"):
        return "the switch compares stock from_pretrained with pinload.ModelCache"
    return None


def median(xs):
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for r in runs:
        if "seconds" not in r:
            continue
        cell = out.setdefault(r["workload"], {}).setdefault(r["case"], {}).setdefault(r["system"], [])
        cell.append(r)
    table = {}
    for workload, cases in out.items():
        for case, systems in cases.items():
            rounds = sorted({r["round"] for rs in systems.values() for r in rs})
            ratios: dict = {}
            for rnd in rounds:
                stock = [r["seconds"] for s in STOCK for r in systems.get(s, []) if r["round"] == rnd]
                if not stock:
                    continue
                best = min(stock)
                for s, rs in systems.items():
                    for r in rs:
                        if r["round"] == rnd:
                            ratios.setdefault(s, []).append(best / r["seconds"])
            table.setdefault(workload, {})[case] = {
                s: {"seconds": median([r["seconds"] for r in rs]), "x_best_stock": median(ratios.get(s, [])),
                    "x_range": [min(ratios[s]), max(ratios[s])] if ratios.get(s) else None,
                    "bytes": rs[0].get("bytes"), "n": len(rs)}
                for s, rs in systems.items()}
    return table


def markdown(table: dict, skipped: dict) -> str:
    lines = ["| workload | case | " + " | ".join(SYSTEMS) + " |", "|---|---|" + "---:|" * len(SYSTEMS)]
    for workload in WORKLOADS:
        for case in ("cold", "restart", "switch back"):
            row = table.get(workload, {}).get(case)
            if not row:
                continue
            cells = []
            for s in SYSTEMS:
                c = row.get(s)
                if c is None:
                    cells.append("–")
                else:
                    x = c["x_best_stock"]
                    cells.append(f"{c['seconds']:.2f} s" + (f" ({x:.2f} ×)" if x is not None and s not in STOCK else ""))
            lines.append(f"| {workload} | {case} | " + " | ".join(cells) + " |")
    if skipped:
        lines.append("")
        lines += [f"- {w} / {s}: {why}" for (w, s), why in sorted(skipped.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("full", "small"), default="full")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--cases", default="cold,restart")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lm-gb", type=float, default=2.2, help="the causal LM's size in GB (bfloat16)")
    ap.add_argument("--device", default=None, help="cuda or cuda:N: the built models are moved there (.to)")
    ap.add_argument("--device-map", action="store_true", help="with --device: built there (device_map=) instead")
    ap.add_argument("--dir", default=None, help="where the models are (default $PINLOAD_MODELS)")
    ap.add_argument("--build", default="build")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--fio-runtime", type=int, default=8)
    ap.add_argument("--shmem-huge-pages", default="advise",
                    help="transparent_hugepage/shmem_enabled while the store runs (restored after; 'keep': as it is)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    started = time.monotonic()
    build = os.path.join(ROOT, a.build)
    paths = generate(a)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(build, "python"), os.path.join(ROOT, "python")])
    env.pop("PINLOAD_STORE", None)
    workloads = [w for w in a.workloads.split(",") if w]
    systems = [s for s in a.systems.split(",") if s]
    cases = [c for c in a.cases.split(",") if c]
    store_dir = tempfile.mkdtemp(prefix="pinload-pipeline-bench-")
    daemon = None
    thp = SHMEM_ENABLED
    thp_before = None
    if "pinload+store" in systems and a.shmem_huge_pages != "keep" and os.access(thp, os.W_OK):
        thp_before = shmem_enabled()
        with open(thp, "w") as f:
            f.write(a.shmem_huge_pages)
    if "pinload+store" in systems:
        total = sum(os.path.getsize(f) for w in workloads for f in files_of(w, paths))
        daemon = Daemon(os.path.join(build, "pinload"), store_dir, int(1.5 * total) + (2 << 30), env=env)
    limits = {}
    for w in workloads:
        files = files_of(w, paths)
        bench_bin = next((p for p in (os.path.join(build, "bench", "pinload-bench"), os.path.join(build, "pinload-bench"))
                          if os.path.exists(p)), os.path.join(build, "bench", "pinload-bench"))
        if not os.path.exists(bench_bin):
            limits[w] = {"error": f"{bench_bin} not built (cmake --build build --target pinload_bench)"}
        elif files and root_can_drop():
            drop_caches()
            # The largest file: a pipeline's components may share tensor names, which one load refuses.
            largest = max(files, key=os.path.getsize)
            limits[w] = fb.limits(bench_bin, [largest], 5, a.fio_runtime)
            limits[w]["page_cache_fill_gbps"] = page_cache_fill(largest)
            log(f"limits {w}: {limits[w]}")
    runs, skipped = [], {}
    try:
        for rnd in range(a.rounds):
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for w in workloads:
                for s in order:
                    why = supported(w, s, paths)
                    if why:
                        skipped[(w, s)] = why
                        continue
                    run_env = dict(env, PINLOAD_STORE=daemon.socket) if s == "pinload+store" else env
                    if w == "switch":
                        drop_caches()
                        r = run_worker(w, s, paths, run_env, a.timeout, a.device, a.device_map)
                        r.update(case="switch back", round=rnd)
                        runs.append(r)
                        log(f"round {rnd} {w:13s} {s:13s} switch back: {r.get('seconds', r.get('error'))}")
                        continue
                    how = None
                    for case in cases:
                        if case == "cold":
                            if daemon is not None:
                                daemon.evict()
                            how = drop_caches()
                        r = run_worker(w, s, paths, run_env, a.timeout, a.device, a.device_map)
                        r.update(case=case, round=rnd, cache=how if case == "cold" else "as the cold worker left it")
                        runs.append(r)
                        shown = f"{r['seconds']:.2f} s" if "seconds" in r else f"error: {r.get('error', '')[-300:]}"
                        log(f"round {rnd} {w:13s} {s:13s} {case:8s} {shown}")
    finally:
        if daemon is not None:
            daemon.stop()
        if thp_before is not None:
            with open(thp, "w") as f:
                f.write(thp_before)
    table = summarize(runs)
    out = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": fb.cpu_name() if hasattr(fb, "cpu_name") else platform.processor(), "cores": os.cpu_count(),
                    "kernel": platform.release()},
        "versions": versions(env),
        "shmem_enabled": shmem_enabled() if thp_before is None and os.path.exists(thp) else a.shmem_huge_pages,
        "device": a.device, "device_map": a.device_map, "limits": limits, "runs": runs, "summary": table,
        "skipped": {f"{w}/{s}": why for (w, s), why in skipped.items()},
        "minutes": (time.monotonic() - started) / 60,
    }
    path = a.out or os.path.join(HERE, "results", f"pipeline.{a.scale}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(markdown(table, skipped))
    log(f"pipeline_bench: {out['minutes']:.1f} min, {path}")
    return 0


def root_can_drop() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def versions(env: dict) -> dict:
    code = ("import json, importlib.metadata as m\nout = {}\n"
            "for p in ('torch', 'diffusers', 'transformers', 'safetensors', 'flashpack', 'accelerate', 'peft'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: pass\nprint(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return json.loads(r.stdout) if r.returncode == 0 else {}


if __name__ == "__main__":
    sys.exit(main())
