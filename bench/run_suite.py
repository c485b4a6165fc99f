#!/usr/bin/env python3
"""Run the whole benchmark suite of docs/benchmarks.md and docs/tuning.md on one set
of files, back to back, and keep the JSON results.

    bench/run_suite.py --bin build-bench/bench/pinload-bench --out bench/results --tag NAME PATH...

Steps (--steps, default all):
  main     pinload-bench: memcpy, fio, read(), pinload cold/re-load/warm  -> NAME.json
  peers    bench/run_peers.py on the same files                           -> NAME.peers.json
  sweep    threads x block-size sweep, cold and warm                     -> NAME.sweep.json
  huge     pinload cold + warm + fresh pool with --huge-pages off, thp, explicit -> NAME.huge-*.json
  direct   pinload cold + warm with --direct on and off                  -> NAME.direct-*.json
--sweep-paths runs the sweep on other (smaller) paths to keep it short. As root, --hugetlb auto
(the default) sets vm.nr_hugepages for each pinload-bench run and restores it after.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"  ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--bin", default="build-bench/bench/pinload-bench")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", required=True)
    ap.add_argument("--steps", default="main,peers,sweep,huge,direct")
    ap.add_argument("--repeat", default="3")
    ap.add_argument("--sweep-paths", nargs="*", default=None)
    ap.add_argument("--hugetlb", default="auto",
                    help="pinload-bench --hugetlb: off leaves vm.nr_hugepages alone (fio then runs with 4 KiB "
                         "buffers only, and --huge-pages explicit falls back to THP)")
    a = ap.parse_args()
    steps = a.steps.split(",")
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, a.tag)
    t0 = time.monotonic()
    if "main" in steps:
        run([a.bin, *a.paths, "--repeat", a.repeat, "--hugetlb", a.hugetlb, "--label", a.tag,
             "--json", base + ".json"])
    if "peers" in steps:
        cmd = [sys.executable, os.path.join(HERE, "run_peers.py"), *a.paths, "--repeat", "2", "--json",
               base + ".peers.json"]
        if os.path.exists(base + ".json"):
            cmd += ["--pinload-json", base + ".json"]
        run(cmd)
    if "sweep" in steps:
        run([a.bin, *(a.sweep_paths or a.paths), "--phases", "sweep", "--sweep-repeat", "2", "--label", a.tag + " sweep",
             "--json", base + ".sweep.json"])
    if "huge" in steps:
        for hp in ("off", "thp", "explicit"):
            run([a.bin, *a.paths, "--phases", "cold,warm,pool", "--repeat", "2", "--huge-pages", hp,
                 "--hugetlb", a.hugetlb,
                 "--label", f"{a.tag} huge-pages {hp}", "--json", f"{base}.huge-{hp}.json"])
    if "direct" in steps:
        for d in ("on", "off"):
            run([a.bin, *a.paths, "--phases", "cold,warm", "--repeat", "2", "--direct", d,
                 "--label", f"{a.tag} direct {d}", "--json", f"{base}.direct-{d}.json"])
    print(f"suite done in {time.monotonic() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
