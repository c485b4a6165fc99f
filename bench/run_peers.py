#!/usr/bin/env python3
"""Load the same checkpoint with the loaders people use today, each in a process of its own.

    bench/run_peers.py [--repeat N] [--json OUT] [--variant fp16] [--convert-dir DIR]
                       [--pinload-json PINLOAD.json] PATH...

PATH is what pinload-bench takes: a .safetensors file, a *.safetensors.index.json,
a model folder, or a diffusers pipeline folder (model_index.json).

Each run is a fresh worker process (peers/worker.py), so that its peak RSS (VmHWM) is
its own and /proc/<pid>/io shows what it read. Systems (peers/adapters.py SYSTEMS; one
that is missing or fails is recorded as skipped with the reason, never dropped):
  safetensors mmap + clone      safetensors.torch.load_file (mmap backend), then a copy of
                                every tensor: the bytes are read and in process memory
  safetensors pread             load_file(backend="pread") (safetensors >= 0.8)
  fastsafetensors               fastsafe_open(files, nogds=True on the CPU)
  runai-model-streamer          SafetensorsStreamer.stream_files + get_tensors
  instanttensor                 its safe_open; CUDA only (skipped with its own message on the CPU)
  tensorizer                    TensorDeserializer(lazy_load=False) of a converted .tensors file
  torch.load mmap + clone       torch.load(mmap=True) of a converted .pt, then a copy of each tensor
  torch.load                    torch.load of the converted .pt (a full read)
  flashpack                     read_flashpack_file of a converted .flashpack file
  safetensors.numpy.load_file, safetensors.safe_open(numpy), mmap + numpy copy
  safetensors lazy mmap (not a load)   load_file alone: nothing is read; shown for reference
  pinload, pinload ModelCache   used by bench/run_all.py, which runs pinload the same way

Converted files (tensorizer, .pt, flashpack) are written once to --convert-dir (not
timed). Every load is verified: the tensor count and bytes, sha1 of three tensors per
file against an independent pread of the file, and on the CPU that at least 90% of the
bytes became resident anonymous memory (a lazy map fails this and is flagged).

Cold: posix_fadvise(DONTNEED) on each file of the set (not a global drop_caches, which
would also evict torch's libraries and make every worker's imports read from disk).
Warm: the files are read once first.

With --pinload-json (the JSON that pinload-bench --json wrote on the same files just
before), a combined table with ratios is printed, as docs/benchmarks.md shows it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from peers import adapters, checkpoint, convert, harness, worker  # noqa: E402

# Each peer is measured cold, then warm (harness.Scenario).
SCENARIOS = (harness.COLD, harness.WARM)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--pinload-json", default=None, help="pinload-bench --json output of the same files")
    ap.add_argument("--peers", default=None, help="comma list of system names (substring match) to run")
    ap.add_argument("--variant", default=None, help="checkpoint variant (fp16, ...) for folders")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--convert-dir", default=None,
                    help="where converted copies (tensorizer, .pt, flashpack) go (default: none are made, "
                         "those peers are skipped)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the worker of earlier versions
    ap.add_argument("--report-only", default=None, metavar="PEERS_JSON",
                    help="run nothing: print the combined table of --pinload-json and this run_peers JSON")
    a = ap.parse_args(argv)
    if a.worker:
        return worker.run_worker(a.worker)
    if a.report_only:
        with open(a.report_only) as f:
            peers = json.load(f)["peers"]
        with open(a.pinload_json) as f:
            print(report.combined_table(json.load(f), peers))
        return 0
    if not a.paths:
        ap.error("PATH required")

    files = checkpoint.resolve(a.paths, a.variant)
    if not files:
        ap.error("no .safetensors file found")
    total = sum(os.path.getsize(p) for p in files)
    print(f"run_peers: {len(files)} file(s), {total / 1e9:.3f} GB", file=sys.stderr)
    digests = checkpoint.reference_digests(files)
    converted = {}
    if a.convert_dir:
        for fmt, ext in (("tensorizer", "tensors"), ("pt", "pt"), ("flashpack", "flashpack")):
            try:
                converted[fmt] = convert.convert(files, fmt, os.path.join(a.convert_dir, f"model.{ext}"))["path"]
            except Exception as e:  # noqa: BLE001
                print(f"convert {fmt}: {e}", file=sys.stderr)
    step = {"paths": a.paths, "files": files, "variant": a.variant, "digests": digests, "converted": converted}
    load_start = os.getloadavg()
    results = {}
    names = [n for n in adapters.DEFAULT_PEERS if not a.peers or any(x.strip() in n for x in a.peers.split(","))]
    for name in names:
        results[name] = harness.measure(name, step, SCENARIOS, a.repeat, device=a.device,
                                        log=lambda line: print(line, file=sys.stderr))

    out = {
        "tool": "run_peers",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cores": os.cpu_count(), "kernel": platform.release(),
                 "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "versions": harness.versions(),
        "paths": a.paths,
        "files": [{"path": p, "bytes": os.path.getsize(p)} for p in files],
        "file_bytes": total,
        "repeat": a.repeat,
        "drop_cache_method": "fadvise_dontneed (the set's files)",
        "peers": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"wrote {a.json}", file=sys.stderr)
    if a.pinload_json:
        with open(a.pinload_json) as f:
            pin = json.load(f)
        print(report.combined_table(pin, results))
    else:
        for name, res in results.items():
            if "skipped" in res:
                print(f"{name:36s} skipped: {res['skipped']}")
            else:
                print(f"{name:36s} cold {res['cold']['best_gbps']:6.2f} GB/s  warm {res['warm']['best_gbps']:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
