#!/usr/bin/env python3
"""MAIO's experiment with an unmodified safetensors load (docs/trace.md), in one command.

    bench/trace_bench.py --pinload build/pinload                  # 512 MB model, T = 2 s
    bench/trace_bench.py --size-mb 2048 --init 5 --rounds 3

Each case starts from a cold page cache (the model's pages dropped with
POSIX_FADV_DONTNEED, or every cache with --drop-all: echo 3 > drop_caches) and runs
a consumer process that sleeps T seconds ("framework init"), then reads every tensor
through safetensors.safe_open (numpy; backend pread or mmap), touches every
page of it (a digest of one byte per page, so the consumer's own CPU time stays
small) and drops it, as a framework moving weights to a device does. The consumer measures its load phase
itself (MAIO's metric); the bench measures the whole start.

  native     the consumer alone
  warm       `pinload warm --template T` started at time zero beside it
  eager      EagerLoad: at its first access the consumer reads the whole model
             (`pinload warm PATH`, waited for, inside its load phase), then loads
  precache   PreCache: the whole model read before the consumer starts
  memlimit   native and `warm --follow --budget` in a memory cgroup of
             --mem-fraction x the model (plus the consumer's own ~40 MB); disk reads
             from the consumer's and the warmer's /proc/<pid>/io
  overhead   a warm-cache load, native and under `pinload trace`

Output: a table and bench/results/trace_bench.json (--out). Needs root (cgroups,
fanotify); the machine's other work makes every figure noisy.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "cli"))
import trace_helpers as th  # noqa: E402



def make_model(path, size_mb):
    rng = np.random.default_rng(0)
    tensors, per = max(8, size_mb // 16), (size_mb << 20) // max(8, size_mb // 16) // 4
    from safetensors.numpy import save_file
    save_file({f"model.layers.{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}, str(path))


def cold(path, drop_all):
    if drop_all:
        subprocess.run(["sync"])
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        th.drop_file_cache(path)


def consume(cmd):
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env=dict(os.environ, DIGEST="pages")).stdout.split()
    return {"total_s": time.perf_counter() - t0, "load_s": float(out[2]), "consumer_read": int(out[1]), "digest": out[0]}


def run_case(case, a, model, template, cg=None):
    base = th.consumer_cmd(model, init=a.init, backend=a.backend_now)
    env = dict(os.environ, DIGEST="pages") | ({"EAGER_WARM": a.pinload} if case == "eager" else {})
    if cg:
        base = cg.enter_cmd(base)
    warmer = None
    t0 = time.perf_counter()
    if case == "precache":
        subprocess.run([a.pinload, "warm", str(model)], check=True, capture_output=True)
    consumer = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if case in ("warm", "memlimit-warm"):
        wcmd = [a.pinload, "warm", "--template", str(template)]
        if case == "memlimit-warm":
            wcmd += ["--follow", str(consumer.pid), "--budget", str(int(a.budget_fraction * model.stat().st_size))]
        if cg:
            wcmd = cg.enter_cmd(wcmd)
        warmer = subprocess.Popen(wcmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = consumer.communicate()
    total = time.perf_counter() - t0
    if consumer.returncode != 0:
        raise RuntimeError(f"{case}: consumer failed: {err}")
    digest, consumer_read, load_s = out.split()
    row = {"case": case, "backend": a.backend_now, "total_s": total, "load_s": float(load_s),
           "consumer_read": int(consumer_read), "digest": digest}
    if warmer:
        wout, _ = warmer.communicate()
        w = json.loads(wout.strip().splitlines()[-1])
        row["warmer_read"] = w["proc_io"]["read_bytes"]
        row["warmer"] = {k: w[k] for k in ("mode", "warmed_bytes", "skipped_bytes", "dropped_bytes", "seconds")}
    row["disk_read"] = row["consumer_read"] + row.get("warmer_read", 0)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pinload", default=str(HERE.parent / "build" / "pinload"))
    p.add_argument("--dir", default=None, help="where the model is written (an ext4/xfs/btrfs folder)")
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--init", type=float, default=2.0, help="T: the simulated framework init, seconds")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--drop-all", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "trace_bench.json"))
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="pinload-trace-bench-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model.safetensors"
    if not model.exists() or abs(model.stat().st_size - (a.size_mb << 20)) > (a.size_mb << 20) // 10:
        make_model(model, a.size_mb)
    size = model.stat().st_size
    reference = consume(th.consumer_cmd(model, init=0))["digest"]  # one byte per page (DIGEST=pages)
    rows = []
    for backend in ("pread", "mmap"):
        a.backend_now = backend
        template = work / f"{backend}.pltemplate"
        r = subprocess.run([a.pinload, "trace", "--template", str(template), "--root", str(work), "--",
                            *th.consumer_cmd(model, backend=backend)], capture_output=True, text=True)
        if r.returncode != 0 or not template.exists():
            sys.exit(f"trace failed: {r.stderr}")
        for rnd in range(a.rounds):
            for case in ("native", "warm", "eager", "precache"):
                cold(model, a.drop_all)
                rows.append(run_case(case, a, model, template) | {"round": rnd})
    a.backend_now = "pread"
    template = work / "pread.pltemplate"
    for rnd in range(a.rounds):
        for case in ("memlimit-native", "memlimit-warm"):
            cg = th.MemoryCgroup(int(a.mem_fraction * size) + (40 << 20))
            try:
                cold(model, a.drop_all)
                rows.append(run_case(case, a, model, template, cg) | {"round": rnd,
                            "limit": int(a.mem_fraction * size) + (40 << 20)})
            finally:
                cg.close()
        # Overhead of tracing a warm load: the file cached, init 0.
        subprocess.run([a.pinload, "warm", str(model)], check=True, capture_output=True)
        for case in ("overhead-native", "overhead-traced"):
            cmd = th.consumer_cmd(model, init=0, backend="pread")
            if case == "overhead-traced":
                cmd = [a.pinload, "trace", "--template", str(work / "o.pltemplate"), "--root", str(work), "--", *cmd]
            res = consume(cmd)
            rows.append({"case": case, "backend": "pread", "round": rnd} | res | {"disk_read": res["consumer_read"]})
    for row in rows:
        assert row["digest"] == reference, row
    meta = {"size": size, "init": a.init, "rounds": a.rounds, "host": os.uname().nodename, "kernel": os.uname().release,
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(sys.argv)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"model {size / 1e6:.0f} MB, T = {a.init} s, {a.rounds} round(s), {meta['date']}, kernel {meta['kernel']}")
    print(f"{'case':18} {'backend':7} {'total s':>8} {'load s':>8} {'disk/size':>9}")
    for key in sorted({(r["case"], r["backend"]) for r in rows}, key=lambda k: [r["case"] for r in rows].index(k[0])):
        sel = [r for r in rows if (r["case"], r["backend"]) == key]
        med = lambda f: statistics.median(r[f] for r in sel)  # noqa: E731
        print(f"{key[0]:18} {key[1]:7} {med('total_s'):8.2f} {med('load_s'):8.3f} {med('disk_read') / size:9.2f}")


if __name__ == "__main__":
    main()
