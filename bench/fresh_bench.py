#!/usr/bin/env python3
"""A new worker's first load, and a library of small files: every system in a fresh process per load.

    sudo bench/fresh_bench.py                       # full scale: 7.8 GB set, 120 LoRA files (~25 min)
    bench/fresh_bench.py --scale 0.02 --loras 12 --rounds 1      # a small run (~3 min)

Workloads (generated once with scripts/gen_checkpoints.py's architectures and random bytes, under
--dir, default $PINLOAD_MODELS/fresh-bench-<scale>):
  set     3 files: a UNet-like fp16 file (the SDXL UNet's first tensors, 5.1 GB), a T5-like bf16
          shard (T5-XXL's first tensors, 2.2 GB) and a CLIP-like fp32 file (CLIP-L, 0.49 GB): 7.8 GB,
          times --scale
  lora    --loras (120) LoRA-like files of 3-25 MB (kohya names over the SDXL UNet's attention and
          projection weights, ranks 4-64, sizes log-uniform, seeded), loaded one file per call
  percall --percall-files (64) files of 1 MiB, loaded one file per call: the fixed cost of a call
          (reported as ms per call)

Systems (bench/peers/adapters.py, each in a fresh worker process per load, timed around the load
call, every byte made resident and checked against an independent pread):
  pinload                    set: pinload.load_files (one call); lora, percall: pinload.torch.load_file per file
  pinload load_files_batch   lora, percall: every file in one pinload.torch.load_files_batch call
  safetensors mmap           load_file (mmap), then one read per 4 KiB page (views of the page cache)
  safetensors pread          load_file(backend="pread")
  safetensors 0.9 mmap/pread the same under safetensors 0.9 (pip-installed into --peers-dir when it
                             installs; its prefetch is CUDA-only and so not a host row)
  fastsafetensors            fastsafe_open(nogds=True) (pip-installed when missing)
  runai-model-streamer       SafetensorsStreamer.stream_files

--fresh-pages huge,small adds each pinload row again with PINLOAD_FRESH_PAGES fixed (the page size
of a fresh pool's memory, docs/tuning.md), beside the default that measures it.

Cases, each system in turn (rotated every round):
  cold      the first start: sync, `echo 3 > /proc/sys/vm/drop_caches` before the worker (run as root);
  restart   a second fresh worker right after it, the page cache as the first one left it (a crashed or
            redeployed worker, a second worker on the node: issue 37);
  warm      "page cache filled beforehand": the files read once (cat) before the worker.
--mem-limit F adds "cold, cgroup" and "restart, cgroup" for the set: the pinload rows, and pinload with
PINLOAD_PAGE_CACHE=bypass (direct reads), each worker in a memory cgroup of F x the set's bytes.
--page-cache keep,bypass adds each pinload row again with PINLOAD_PAGE_CACHE fixed, beside the default. --rounds (3) rounds; each round rotates the order of the systems and
first measures the machine's limits on the set's files with pinload-bench --phases fio,pool: fio's
direct sequential read (numjobs=1, best variant) and the first touch of a fresh pool's memory
after the page cache was dropped and the memory left idle (the rate at which fresh anonymous memory
arrives: the bound of any cold load that lands in new memory). Medians over the rounds.

--device cuda:N runs the same loads to a GPU (scripts/gpu-check.sh runs the set there): a fresh
process's device load, where pinning the staging memory plays the part of fresh memory.

Output: --out JSON (default bench/results/fresh.<scale>.json) and a markdown table on stdout, in the
form of docs/benchmarks.md's section "A fresh process per load".
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import checkpoint, harness  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gen_checkpoints as gen  # noqa: E402

# The set's files: (name, bytes at scale 1, tensors).
SET_BYTES = {"unet": 5_135_000_000, "t5": 2_200_000_000, "clip": 492_000_000}
ST09 = "safetensors==0.9.0rc1"

SYSTEMS = {
    "set": ["pinload", "safetensors mmap", "safetensors pread", "safetensors 0.9 mmap", "safetensors 0.9 pread",
            "fastsafetensors", "runai-model-streamer"],
    "lora": ["pinload load_file", "pinload load_files_batch", "safetensors mmap", "safetensors pread",
             "safetensors 0.9 mmap", "safetensors 0.9 pread", "fastsafetensors", "runai-model-streamer"],
}
SYSTEMS["percall"] = SYSTEMS["lora"]
PINLOAD_ROWS = ("pinload", "pinload load_file", "pinload load_files_batch")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- checkpoints ----

def _first(tensors, budget):
    """The first tensors (in module order) whose bytes fit `budget`; at least one."""
    out, total = [], 0
    for t in tensors:
        if out and total + t.nbytes > budget:
            break
        out.append(t)
        total += t.nbytes
    return out


def _unet_tensors():
    try:
        return gen.meta_tensors("UNet2DConditionModel", gen.SDXL_UNET, "F16")
    except Exception as e:  # noqa: BLE001  (diffusers missing: the FLUX transformer's names)
        log(f"fresh_bench: SDXL UNet from diffusers unavailable ({e}); using the FLUX transformer's tensors")
        return [gen.T(t.name, t.shape, "F16") for t in gen.flux_transformer()]


def _lora_tensors(unet, target, rng):
    """kohya-style LoRA tensors over the UNet's 2-D weights (attention and projections), rank
    and module count chosen to reach about `target` bytes."""
    mods = [t for t in unet if len(t.shape) == 2 and t.name.endswith(".weight") and
            any(k in t.name for k in ("to_q", "to_k", "to_v", "to_out", "proj_in", "proj_out", "ff.net"))]
    rank = rng.choice([4, 8, 16, 32, 64])
    out, total = [], 0
    while total < target:
        for m in mods:
            if total >= target:
                break
            o, i = m.shape
            base = "lora_unet_" + m.name[: -len(".weight")].replace(".", "_")
            if any(t.name.startswith(base + ".") for t in out):
                rank = max(1, rank // 2)  # went round once: finer steps
                base += f"_r{rank}"
            out += [gen.T(base + ".lora_down.weight", (rank, i), "F16"), gen.T(base + ".lora_up.weight", (o, rank), "F16"),
                    gen.T(base + ".alpha", (), "F32")]
            total += 2 * rank * (i + o) + 4
    return out


def generate(root: str, scale: float, loras: int, percall_files: int, seed: int = 0) -> dict:
    """Writes the workloads' files (kept when they exist with the right header: gen.write_file)."""
    rnd = gen.RandomBytes(seed)
    unet = _unet_tensors()
    sets = {"set": [], "lora": [], "percall": []}
    specs = [("unet", "diffusion_pytorch_model.fp16.safetensors", unet),
             ("t5", "model-00001-of-00002.safetensors", gen.t5_encoder()),
             ("clip", "model.safetensors", gen.clip_text(dtype="F32"))]
    for name, fname, tensors in specs:
        d = os.path.join(root, "set", name)
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, fname)
        gen.write_file(p, _first(tensors, SET_BYTES[name] * scale), rnd, False)
        sets["set"].append(p)
    rng = random.Random(seed)
    d = os.path.join(root, "lora")
    os.makedirs(d, exist_ok=True)
    for i in range(loras):
        target = math.exp(rng.uniform(math.log(3e6), math.log(25e6)))
        p = os.path.join(d, f"lora-{i:03d}.safetensors")
        gen.write_file(p, _lora_tensors(unet, target, rng), rnd, False)
        sets["lora"].append(p)
    d = os.path.join(root, "percall")
    os.makedirs(d, exist_ok=True)
    for i in range(percall_files):
        p = os.path.join(d, f"one-mib-{i:03d}.safetensors")
        gen.write_file(p, _lora_tensors(unet, 1 << 20, random.Random(1000 + i))[:], rnd, False)
        sets["percall"].append(p)
    return sets


# ---- peers ----

PIP_PEERS = {"fastsafetensors": "fastsafetensors", "runai-model-streamer": "runai_model_streamer"}


def setup_peers(peers_dir: str, want_st09: bool) -> dict:
    """fastsafetensors and runai-model-streamer where missing (pip, as run_all.py does); safetensors 0.9
    into peers_dir."""
    out = {}
    for pip_name, module in PIP_PEERS.items():
        if importlib.util.find_spec(module) is None:
            log(f"fresh_bench: pip install {pip_name}")
            out[f"{module}_pip"] = subprocess.run([sys.executable, "-m", "pip", "install", "-q", pip_name]).returncode
    st09 = os.path.join(peers_dir, "safetensors-0.9")
    if want_st09 and not os.path.isdir(os.path.join(st09, "safetensors")):
        log(f"fresh_bench: pip install --target {st09} {ST09}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--pre", "--target", st09, ST09])
        out["safetensors_0.9_pip"] = r.returncode
    out["safetensors_0.9_path"] = st09 if os.path.isdir(os.path.join(st09, "safetensors")) else None
    return out


# ---- limits ----

def limits(bench_bin: str, files: list[str], settle: int, fio_runtime: int) -> dict:
    """fio direct reads and a fresh pool's first touch on the set's files (pinload-bench)."""
    import tempfile
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "limits.json")
        cmd = [bench_bin, "--phases", "fio,pool", "--repeat", "1", "--pool-settle", str(settle),
               "--fio-runtime", str(fio_runtime), "--json", out, *files]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            return {"error": (r.stderr or r.stdout)[-500:]}
        with open(out) as f:
            res = json.load(f)["results"]
    fio = res.get("fio", {})
    pool = res.get("pool_reserve", {})
    return {"fio_gbps": fio.get("best_gbps"), "fio_parallel_gbps": fio.get("parallel_best_gbps"),
            "fio_error": fio.get("error"), "first_touch_gbps": pool.get("gbps"), "pool": pool}


# ---- runs ----

def run_one(system: str, workload: str, files: list[str], digests: dict, cold: bool, env: dict,
            device: str = "cpu", case: str | None = None, keep_cache: bool = False, mem_limit: int | None = None,
            sentinel: str | None = None, paths: list[str] | None = None) -> dict:
    # paths: what the worker loads where it is not the local files (URLs of copies of them)
    step = {"paths": paths or files, "files": files, "digests": digests, "label": workload}
    r = harness.run_system(system, [step], device=device, cold=cold, drop_all=True, env=env, timeout=3600,
                           keep_cache=keep_cache, mem_limit=mem_limit, sentinel=sentinel)
    rec = {"system": system, "workload": workload, "case": case or ("cold" if cold else "warm"), "cache": r.get("cache"),
           "cached_bytes_before": r.get("cached_bytes_before")}
    if "cgroup" in r:
        rec["cgroup"] = r["cgroup"]
    # The sentinel gone: another process dropped (or memory pressure evicted) the page cache since
    # the first start's drop, so what the first start left may be gone: unless the files are all
    # still cached, the restart measured the disk, not the restart.
    if r.get("sentinel_cached") is False and (r.get("cached_bytes_before") or 0) < sum(map(os.path.getsize, files)):
        rec["skipped"] = "page cache dropped or evicted by another process between the first start and the restart"
        return rec
    if "skipped" in r or "error" in r:
        rec["skipped"] = r.get("skipped") or r.get("error")
        return rec
    s = r["steps"][0]
    rec.update(seconds=s["seconds"], gbps=s["gbps"], bytes=s["bytes_expected"], files=len(files),
               ms_per_call=1e3 * s["seconds"] / len(files), verified=s["verify"]["ok"],
               resident=s.get("resident"), version=r.get("version"), peak_rss=r.get("vmhwm"))
    if not s["verify"]["ok"]:
        rec["verify"] = s["verify"]
    return rec


def median(xs):
    return statistics.median(xs) if xs else None


def same_round_ratios(systems: dict, best: str) -> dict:
    """For each pinload row: the median over rounds of its GB/s over the best peer's in the same round
    (the disk's speed drifts between rounds more than the systems differ), with the per-round ratios."""
    peer = {r["round"]: r["gbps"] for r in systems.get(best, [])}
    out = {}
    for name in [n for n in systems if n.startswith("pinload")]:
        ratios = [r["gbps"] / peer[r["round"]] for r in systems.get(name, []) if r["round"] in peer]
        if ratios:
            out[name] = {"median": median(ratios), "rounds": ratios}
    return out


def summarize(runs: list[dict], lims: list[dict]) -> dict:
    cells = {}
    for r in runs:
        if "gbps" not in r or not r.get("verified"):
            continue
        c = cells.setdefault((r["workload"], r["case"]), {}).setdefault(r["system"], [])
        c.append(r)
    out = {}
    for (w, case), systems in cells.items():
        row = {}
        for name, rs in systems.items():
            row[name] = {"gbps": median([x["gbps"] for x in rs]), "ms_per_call": median([x["ms_per_call"] for x in rs]),
                         "rounds": len(rs)}
        peers = {k: v for k, v in row.items() if k not in PINLOAD_ROWS and not k.startswith("pinload")}
        # in the cgroup, pinload's own direct reads are the reference
        peers = peers or {k: v for k, v in row.items() if "page_cache=bypass" in k}
        best = max(peers, key=lambda k: peers[k]["gbps"]) if peers else None
        out[f"{w}/{case}"] = {"systems": row, "best_peer": best,
                              "same_round": same_round_ratios(systems, best) if best else {}}
    fio = [x["fio_gbps"] for x in lims if x.get("fio_gbps")]
    touch = [x["first_touch_gbps"] for x in lims if x.get("first_touch_gbps")]
    out["limits"] = {"fio_gbps": median(fio), "first_touch_gbps": median(touch)}
    return out


def table(summary: dict, set_bytes: int, loras: int, percall_bytes: float) -> str:
    lim = summary["limits"]
    fio, touch = lim.get("fio_gbps"), lim.get("first_touch_gbps")
    lines = [f"| workload | case | pinload | pinload batch | best peer | pinload / best peer | same round | "
             f"fio direct | first touch |", "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    names = {"set": f"{set_bytes / 1e9:.2f} GB set of 3 files",
             "lora": f"{loras} LoRA-like files of 3-25 MB, one file per call",
             "percall": f"{percall_bytes / 1e6:.1f} MB files, one file per call (ms per call)"}
    labels = {"cold": "first start (cold)", "restart": "restart", "warm": "page cache filled beforehand",
              "cold, cgroup": "first start, cgroup", "restart, cgroup": "restart, cgroup"}
    for w in ("set", "lora", "percall"):
        for case in labels:
            cell = summary.get(f"{w}/{case}")
            if not cell:
                continue
            row = cell["systems"]
            key = "ms_per_call" if w == "percall" else "gbps"
            unit = " ms" if w == "percall" else ""
            pin = row.get("pinload") or row.get("pinload load_file")
            batch = row.get("pinload load_files_batch")
            best = cell["best_peer"]
            bp = row.get(best) if best else None

            def f(x):
                return "-" if x is None else (f"{x[key]:.3f}{unit}" if w == "percall" else f"{x[key]:.2f}")
            ratio = "-"
            if pin and bp:
                ratio = f"{(bp[key] / pin[key]) if w == 'percall' else (pin[key] / bp[key]):.2f}x"
            lim_cells = (f"{fio:.2f}" if fio and case == "cold" and w != "percall" else "",
                         f"{touch:.2f}" if touch and case == "cold" and w != "percall" else "")
            same = cell.get("same_round", {})
            same_cell = " / ".join(f"{same[n]['median']:.2f}x" for n in PINLOAD_ROWS if n in same) or "-"
            lines.append(f"| {names[w]} | {labels[case]} | {f(pin)} | {f(batch)} | {f(bp)} ({best}) | {ratio} | {same_cell} | "
                         f"{lim_cells[0]} | {lim_cells[1]} |")
    detail = ["", "| workload | case | " + " | ".join(["system", "median", "rounds"]) + " |", "|---|---|---|---:|---:|"]
    for k, cell in summary.items():
        if k == "limits":
            continue
        w, case = k.split("/")
        for name, v in sorted(cell["systems"].items(), key=lambda kv: -kv[1]["gbps"]):
            m = f"{v['ms_per_call']:.3f} ms/call" if w == "percall" else f"{v['gbps']:.2f} GB/s"
            detail.append(f"| {w} | {case} | {name} | {m} | {v['rounds']} |")
    return "\n".join(lines + detail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="the set's bytes, times 7.8 GB (default 1)")
    ap.add_argument("--loras", type=int, default=120)
    ap.add_argument("--percall-files", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="set,lora,percall")
    ap.add_argument("--systems", default=None, help="comma list of substrings: run only matching systems")
    ap.add_argument("--dir", default=None, help="where the checkpoints are generated")
    ap.add_argument("--build", default="build", help="the build tree (its python/ and bench/pinload-bench)")
    ap.add_argument("--peers-dir", default=os.path.join(HERE, ".peers"), help="where safetensors 0.9 is installed")
    ap.add_argument("--no-st09", action="store_true", help="skip the safetensors 0.9 rows")
    ap.add_argument("--pool-settle", type=int, default=10, help="idle seconds before the first-touch probe")
    ap.add_argument("--fio-runtime", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="the load's target: cpu (the issue's table) or cuda:N "
                    "(a fresh process's device load: pinload streams through pinned staging; scripts/gpu-check.sh)")
    ap.add_argument("--fresh-pages", default="",
                    help="comma list of PINLOAD_FRESH_PAGES values (huge, small): each adds the pinload rows "
                    "again as 'ROW [pages=V]', beside the measured default (docs/tuning.md)")
    ap.add_argument("--page-cache", default="",
                    help="comma list of PINLOAD_PAGE_CACHE values (keep, bypass): each adds the set's pinload row again as "
                    "'ROW [page_cache=V]', beside the default rule (Note [Keeping the page cache])")
    ap.add_argument("--mem-limit", type=float, default=0,
                    help="adds the set's restart pairs for pinload (default, page_cache=bypass and the --page-cache rows) in a memory cgroup "
                    "of this many times the set's bytes (1.5: it cannot hold the set twice)")
    ap.add_argument("--cases", default="cold,restart,warm",
                    help="comma list of cold (with restart: the pairs), warm; e.g. cold,restart for a shorter run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        log("fresh_bench: not root: cold runs evict the files with fadvise instead of drop_caches")
    root = a.dir or os.path.join(gen.default_out(), f"fresh-bench-{a.scale:g}")
    t0 = time.monotonic()
    sets = generate(root, a.scale, a.loras, a.percall_files)
    log(f"fresh_bench: files ready in {time.monotonic() - t0:.0f} s under {root}")
    peers = setup_peers(a.peers_dir, not a.no_st09)
    build = os.path.join(ROOT, a.build)
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join([os.path.join(build, "python"), os.path.join(ROOT, "python")]
                                             + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else []))
    st09_env = None
    if peers.get("safetensors_0.9_path"):
        st09_env = dict(base_env, PYTHONPATH=peers["safetensors_0.9_path"] + os.pathsep + base_env["PYTHONPATH"])
    workloads = [w for w in a.workloads.split(",") if w]
    digests = {w: checkpoint.reference_digests(sets[w]) for w in workloads}
    runs, lims = [], []
    # Read after each cold drop, looked for before each restart (harness.run_system).
    sentinel = os.path.join(root, "sentinel.bin")
    if not os.path.exists(sentinel):
        with open(sentinel, "wb") as f:
            f.write(os.urandom(1 << 20))
    for rnd in range(a.rounds):
        lim = limits(os.path.join(build, "bench", "pinload-bench"), sets["set"], a.pool_settle, a.fio_runtime)
        lim["round"] = rnd
        lims.append(lim)
        log(f"[round {rnd + 1}] limits: fio {lim.get('fio_gbps')} GB/s, first touch {lim.get('first_touch_gbps')} GB/s"
            + (f" ({lim['error']})" if "error" in lim else ""))
        for w in workloads:
            names = [n for n in SYSTEMS[w] if not a.systems or any(x in n for x in a.systems.split(","))]
            base = [n for n in names if n in PINLOAD_ROWS]
            names += [f"{n} [pages={v}]" for v in a.fresh_pages.split(",") if v for n in base]
            names += [f"{n} [page_cache={v}]" for v in a.page_cache.split(",") if v and w == "set" for n in base]
            k = rnd % len(names)
            order = names[k:] + names[:k]  # rotated every round

            def one(name, case, mem_limit=None):
                if name.startswith("safetensors 0.9") and st09_env is None:
                    runs.append({"system": name, "workload": w, "case": case, "round": rnd,
                                 "skipped": f"{ST09} did not install"})
                    return
                env = st09_env if name.startswith("safetensors 0.9") else base_env
                system, _, variant = name.partition(" [")
                if variant.startswith("pages="):
                    env = dict(env, PINLOAD_FRESH_PAGES=variant[len("pages="):].rstrip("]"))
                elif variant.startswith("page_cache="):
                    env = dict(env, PINLOAD_PAGE_CACHE=variant[len("page_cache="):].rstrip("]"))
                r = run_one(system, w, sets[w], digests[w], case.startswith("cold"), env, a.device, case=case,
                            keep_cache=case.startswith("restart"), mem_limit=mem_limit, sentinel=sentinel)
                r["system"] = name
                r["round"] = rnd
                runs.append(r)
                shown = (f"{r['ms_per_call']:.3f} ms/call" if w == "percall" else f"{r['gbps']:.2f} GB/s") \
                    if "gbps" in r else f"skipped: {r['skipped'][:200]}"
                flag = "" if r.get("verified", True) else f" NOT VERIFIED {r.get('verify')}"
                cached = r.get("cached_bytes_before")
                note = f" ({cached / 1e9:.2f} GB cached before)" if case.startswith("restart") and cached is not None else ""
                log(f"[round {rnd + 1}] {w} {case} {name}: {shown}{flag}{note}")

            cases = a.cases.split(",")
            for name in order:  # one drop, then two fresh workers in a row
                if "cold" in cases:
                    one(name, "cold")
                if "restart" in cases:
                    one(name, "restart")
            if w == "set" and a.mem_limit:
                limit = int(a.mem_limit * sum(os.path.getsize(p) for p in sets[w]))
                pair = ["pinload", "pinload [page_cache=bypass]"] + [
                    f"pinload [page_cache={v}]" for v in a.page_cache.split(",") if v and v != "bypass"]
                for name in (pair if rnd % 2 == 0 else pair[::-1]):
                    one(name, "cold, cgroup", limit)
                    one(name, "restart, cgroup", limit)
            for name in order if "warm" in cases else []:
                one(name, "warm")
    summary = summarize(runs, lims)
    out = {"tool": "fresh_bench", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
           "host": {"cores": os.cpu_count(), "kernel": platform.release(), "loadavg_at_end": os.getloadavg()},
           "versions": harness.versions(), "peers": peers, "scale": a.scale, "rounds": a.rounds,
           "device": a.device, "mem_limit": a.mem_limit,
           "files": {w: {"count": len(sets[w]), "bytes": sum(os.path.getsize(p) for p in sets[w])} for w in sets},
           "limits": lims, "runs": runs, "summary": summary, "seconds": time.monotonic() - t0}
    suffix = "" if a.device == "cpu" else "." + a.device.replace(":", "")
    path = a.out or os.path.join(HERE, "results", f"fresh.{a.scale:g}{suffix}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    log(f"fresh_bench: wrote {path} ({time.monotonic() - t0:.0f} s)")
    files = out["files"]
    print(table(summary, files["set"]["bytes"], a.loras, files["percall"]["bytes"] / max(files["percall"]["count"], 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
