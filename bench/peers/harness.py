"""The harness: runs one system in a fresh worker process under a scenario, and
aggregates repeated runs.

A Scenario is plain data: whether the set's files are evicted from the page cache
(cold) or read once (warm) before the worker starts, the steps the worker loads one
after the other (one load, a re-load in the same process, a pipeline switch), and the
memory cgroup it runs in. run_peers.py measures every peer under COLD and WARM;
run_all.py adds switching and a memory limit. A new scenario (a fresh process per load,
a remote source) is one more Scenario, or a steps function, not a new loop.

run_system() samples /proc/<pid>/io every sample_ms, records the worker's exit status,
peak RSS and the cgroup's peak, and never raises for a failing system: the record says
"skipped" or "error" with the reason.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from typing import Callable

from .page_cache import cached_bytes, drop_caches, evict, read_all

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The worker process: this interpreter, with bench/ first on sys.path (as a script in
# bench/ would have it), running peers.worker.main(SPEC).
WORKER_COMMAND = [sys.executable, "-c",
                  "import sys; sys.path[0] = sys.argv[1]; from peers.worker import main; sys.exit(main(sys.argv[2]))",
                  _BENCH]


def one_load(step: dict) -> list[dict]:
    """The worker loads the set once."""
    return [step]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How a worker runs: `cold` evicts the set's files first (else they are read once),
    `steps(step)` is what it loads (default: one load of the set), `mem_limit` the bytes
    of a memory cgroup around it (None: no cgroup)."""
    name: str
    cold: bool = True
    steps: Callable[[dict], list[dict]] = one_load
    mem_limit: int | None = None


COLD = Scenario("cold", cold=True)
WARM = Scenario("warm", cold=False)


def _cgroup_for(limit_bytes: int | None):
    """A memory cgroup under this process's own: v2 where the memory controller is
    there, else v1. Returns (procs_file, reader) or raises OSError."""
    if not limit_bytes:
        return None
    with open("/proc/self/cgroup") as f:
        lines = [ln.strip().split(":", 2) for ln in f]
    v2 = next((p for h, c, p in lines if h == "0"), None)
    if v2 is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            if "memory" in f.read().split():
                d = os.path.join("/sys/fs/cgroup", v2.lstrip("/"), "pinload-bench")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "memory.max"), "w") as f:
                    f.write(str(limit_bytes))
                return {"kind": "v2", "dir": d, "procs": os.path.join(d, "cgroup.procs"),
                        "peak": os.path.join(d, "memory.peak"), "events": os.path.join(d, "memory.events")}
    v1 = next((p for h, c, p in lines if "memory" in c.split(",")), None)
    if v1 is None:
        raise OSError("no memory cgroup (neither v2 with the memory controller nor v1)")
    d = os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"), "pinload-bench")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_bytes))
    with open(os.path.join(d, "memory.max_usage_in_bytes"), "w") as f:
        f.write("0")  # reset the peak
    with open(os.path.join(d, "memory.failcnt"), "w") as f:
        f.write("0")
    return {"kind": "v1", "dir": d, "procs": os.path.join(d, "cgroup.procs"),
            "peak": os.path.join(d, "memory.max_usage_in_bytes"), "failcnt": os.path.join(d, "memory.failcnt")}


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def run_system(name: str, steps: list[dict], device: str = "cpu", options: dict | None = None,
               cold: bool = True, mem_limit: int | None = None, sample_ms: int = 50, timeout: int = 1800,
               env: dict | None = None, drop_all: bool = False, keep_cache: bool = False,
               sentinel: str | None = None) -> dict:
    """Run one system in a worker process: drop the page cache first (cold: the set's files,
    or with drop_all the whole cache, `echo 3 > drop_caches` as root) or read the files once
    (warm), or with keep_cache neither (a restart: the page cache as the last worker left it), sample /proc/<pid>/io
    every sample_ms. `sentinel`: a small file read into the page cache after a cold drop and looked for
    before a keep_cache run (res["sentinel_cached"]): gone means another process dropped the page
    cache in between (a shared machine), and the restart measured nothing. every sample_ms, hold it in a memory cgroup of mem_limit
    bytes if asked. Returns the worker's record plus the samples, exit status, peak RSS and
    the cgroup's peak."""
    import subprocess
    import tempfile
    files = [f for s in steps for f in s["files"]]
    res = {"system": name, "device": device}
    if keep_cache:
        res["cache"] = "as left"
        res["cached_bytes_before"] = cached_bytes(sorted(set(files)))
        if sentinel:
            res["sentinel_cached"] = cached_bytes([sentinel]) == os.path.getsize(sentinel)
    elif cold:
        res["cache"] = drop_caches(sorted(set(files)), 3) if drop_all else evict(sorted(set(files)))
        if sentinel:
            read_all([sentinel])
        res["cached_bytes_before"] = cached_bytes(sorted(set(files)))
    else:
        read_all(sorted(set(files)))
        res["cache"] = "warm (read once)"
    cg = None
    if mem_limit:
        try:
            cg = _cgroup_for(mem_limit)
            res["cgroup"] = {"kind": cg["kind"], "limit": mem_limit}
        except OSError as e:
            res["cgroup"] = {"error": str(e), "limit": mem_limit}
    with tempfile.TemporaryDirectory() as td:
        spec = {"system": name, "steps": steps, "device": device, "options": options or {},
                "out": os.path.join(td, "out.json")}
        with open(os.path.join(td, "spec.json"), "w") as f:
            json.dump(spec, f)

        def enter_cgroup():
            if cg:
                with open(cg["procs"], "w") as f:
                    f.write(str(os.getpid()))
        t_start = time.monotonic()
        p = subprocess.Popen(WORKER_COMMAND + [os.path.join(td, "spec.json")],
                             preexec_fn=enter_cgroup, env=env, stderr=subprocess.PIPE, text=True)
        samples = []
        io_path = f"/proc/{p.pid}/io"
        deadline = t_start + timeout
        while p.poll() is None:
            now = time.monotonic()
            txt = _read(io_path)
            if txt:
                kv = dict(ln.split(": ") for ln in txt.splitlines())
                samples.append((round(now, 4), int(kv["read_bytes"]), int(kv["rchar"])))
            if now > deadline:
                p.kill()
            time.sleep(sample_ms / 1000)
        err = p.stderr.read()
        res["exit"] = p.returncode
        res["wall_seconds"] = time.monotonic() - t_start
        if os.path.exists(spec["out"]):
            with open(spec["out"]) as f:
                res.update(json.load(f))
        elif p.returncode < 0:
            res["error"] = f"killed by signal {-p.returncode}" + (
                " (the cgroup's OOM killer: peak above the limit)" if cg and p.returncode == -9 else "")
        else:
            res["error"] = f"worker exit {p.returncode}: {err[-1500:]}"
        if err and ("error" in res or "skipped" in res):
            res["stderr_tail"] = err[-1500:]
    if cg:
        res["cgroup"]["peak"] = int(_read(cg["peak"]) or 0) or None
        if cg["kind"] == "v1":
            res["cgroup"]["failcnt"] = int(_read(cg["failcnt"]) or 0)
        else:
            res["cgroup"]["events"] = _read(cg["events"])
        try:
            os.rmdir(cg["dir"])
        except OSError:
            pass
    # keep the samples that cover the steps (and a little before), relative to the first step
    if res.get("steps"):
        t0 = res["steps"][0]["t0"]
        base = None
        keep = []
        for t, rb, rc in samples:
            if t < t0 - 0.2:
                base = (rb, rc)
                continue
            keep.append((round(t - t0, 3), rb, rc))
        if base is None and keep:
            base = keep[0][1:]
        res["io_samples"] = [(t, rb - base[0], rc - base[1]) for t, rb, rc in keep] if keep else []
    return res


def summary(res: dict) -> str:
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    if "error" in res:
        return f"FAILED: {res['error'][:300]}"
    parts = []
    for s in res.get("steps", []):
        v = s["verify"]
        parts.append(f"{s['label']}: {s['seconds']:.2f} s {s['gbps']:.2f} GB/s"
                     + ("" if v["ok"] else f" NOT VERIFIED {v.get('lazy') or v}"))
    return "; ".join(parts) + f"; peak RSS {(res.get('vmhwm') or 0) / 1e9:.2f} GB"



def run_scenario(scenario: Scenario, system: str, step: dict, device: str = "cpu", options: dict | None = None,
                 env: dict | None = None, timeout: int = 1800) -> dict:
    """One worker of `system` under `scenario` on the set that `step` describes."""
    return run_system(system, scenario.steps(step), device=device, options=options, cold=scenario.cold,
                      mem_limit=scenario.mem_limit, env=env, timeout=timeout)


def aggregate(runs: list[dict]) -> dict:
    """Best and median GB/s of repeated runs, with the runs."""
    gb = sorted(r["gbps"] for r in runs)
    med = gb[len(gb) // 2] if len(gb) % 2 else (gb[len(gb) // 2 - 1] + gb[len(gb) // 2]) / 2
    return {"best_gbps": gb[-1], "median_gbps": med, "runs": runs}


def measure(system: str, step: dict, scenarios, repeat: int, device: str = "cpu", log=None) -> dict:
    """`repeat` workers of `system` per scenario, in order: {scenario name: aggregate}, or
    {"skipped": reason} as soon as one run is skipped or fails."""
    rec = {}
    for scenario in scenarios:
        runs = []
        for _ in range(repeat):
            r = run_scenario(scenario, system, step, device=device)
            if log:
                log(f"[{system}] {scenario.name}: {summary(r)}")
            if "skipped" in r or "error" in r:
                return {"skipped": r.get("skipped") or r["error"]}
            s0 = r["steps"][0]
            runs.append({"seconds": s0["seconds"], "gbps": s0["gbps"], "bytes": s0["bytes_expected"],
                         "peak_rss": r.get("vmhwm"), "verify": s0["verify"]})
        rec[scenario.name] = aggregate(runs)
    return rec


def versions() -> dict:
    """Python and the version of every package a system uses, where installed."""
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for pkg in ("numpy", "safetensors", "torch", "fastsafetensors", "runai-model-streamer", "tensorizer",
                "instanttensor", "flashpack", "ml_dtypes", "diffusers", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
