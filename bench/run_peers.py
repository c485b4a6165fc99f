#!/usr/bin/env python3
"""Load the same checkpoint with the Python loaders people use today, cold and warm.

    bench/run_peers.py [--repeat N] [--json OUT] [--pinload-json PINLOAD.json] PATH...

PATH is what pinload-bench takes: a .safetensors file, a *.safetensors.index.json,
a model folder, or a diffusers pipeline folder (model_index.json).

Peers (each skipped with a message when its module is missing):
  safetensors.numpy.load_file   every file into a dict of numpy arrays (mmap + copy);
                                BF16 needs ml_dtypes (pip install ml_dtypes)
  safetensors.safe_open(numpy)  get_tensor() of every key, one file open at a time
  mmap + numpy copy             the raw mmap path with no dtype handling: np.frombuffer
                                over an mmap of the file, .copy() per tensor
  safetensors.torch.load_file   needs torch: "+ clone" copies every tensor out of the mmap
                                (the bytes are then read and in process memory); "lazy"
                                only maps the file (no byte is read: not a load, shown for
                                reference)
  torch pinned copy             safetensors.torch.load_file then .pin_memory(); needs
                                torch with CUDA

Cold: `echo 1 > /proc/sys/vm/drop_caches` when root, else posix_fadvise(DONTNEED) on
each file (the JSON says which). Warm: the files are read once first.

With --pinload-json (the JSON that pinload-bench --json wrote on the same files just
before), a combined table with ratios is printed, as docs/benchmarks.md shows it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import mmap
import os
import platform
import struct
import sys
import time

# ---------------------------------------------------------------- files


def _variant_free(name: str) -> bool:
    stem = name[: -len(".safetensors")]
    return "." not in stem


def _resolve_folder(d: str) -> list[str]:
    names = sorted(os.listdir(d))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if indexes:
        return _resolve_index(os.path.join(d, indexes[0]))
    return [os.path.join(d, n) for n in names if n.endswith(".safetensors") and _variant_free(n)]


def _resolve_index(path: str) -> list[str]:
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    d = os.path.dirname(path)
    return [os.path.join(d, s) for s in sorted(set(weight_map.values()))]


def resolve(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            if os.path.exists(os.path.join(p, "model_index.json")):
                for sub in sorted(os.listdir(p)):
                    sd = os.path.join(p, sub)
                    if os.path.isdir(sd) and any(n.endswith(".safetensors") for n in os.listdir(sd)):
                        out += _resolve_folder(sd)
            else:
                out += _resolve_folder(p)
        elif p.endswith(".json"):
            out += _resolve_index(p)
        else:
            out.append(p)
    return out


def header(path: str):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return 8 + n, h


# ---------------------------------------------------------------- page cache


def drop_caches(files: list[str]) -> str:
    os.sync()
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def read_all(files: list[str]):
    buf = bytearray(1 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ---------------------------------------------------------------- peers


def peer_st_numpy(files):
    from safetensors.numpy import load_file
    out = {}
    for p in files:
        out.update(load_file(p))
    return out


def peer_safe_open(files):
    from safetensors import safe_open
    out = {}
    for p in files:
        with safe_open(p, framework="numpy") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def peer_mmap_copy(files):
    import numpy as np
    out = {}
    for p in files:
        start, h = header(p)
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for k, t in h.items():
                b, e = t["data_offsets"]
                out[k] = np.frombuffer(mm, dtype=np.uint8, count=e - b, offset=start + b).copy()
        finally:
            mm.close()
    return out


def peer_st_torch_lazy(files):
    # Tensors over the file's mmap: nothing is read until a page is touched.
    from safetensors.torch import load_file
    out = {}
    for p in files:
        out.update(load_file(p, device="cpu"))
    return out


def peer_st_torch(files):
    # What a user gets once the bytes are in process memory (as load_state_dict
    # or a copy to a device needs them): mmap, fault in, copy.
    from safetensors.torch import load_file
    out = {}
    for p in files:
        for k, v in load_file(p, device="cpu").items():
            out[k] = v.clone()
    return out


def peer_torch_pinned(files):
    from safetensors.torch import load_file
    out = {}
    for p in files:
        for k, v in load_file(p, device="cpu").items():
            out[k] = v.pin_memory()
    return out


def need_numpy_bf16(files):
    import numpy as np  # noqa: F401
    if any(t["dtype"] == "BF16" for p in files for t in header(p)[1].values()):
        try:
            import ml_dtypes  # noqa: F401  (registers numpy's bfloat16)
        except ImportError:
            raise ImportError("BF16 tensors need ml_dtypes for numpy (pip install ml_dtypes)")


def need_torch(files):
    import torch  # noqa: F401


def need_cuda(files):
    import torch
    if not torch.cuda.is_available():
        raise ImportError("torch has no CUDA device: pinning needs one")


PEERS = [
    ("safetensors.numpy.load_file", peer_st_numpy, need_numpy_bf16),
    ("safetensors.safe_open(numpy)", peer_safe_open, need_numpy_bf16),
    ("mmap + numpy copy", peer_mmap_copy, lambda files: __import__("numpy")),
    ("safetensors.torch.load_file + clone", peer_st_torch, need_torch),
    ("safetensors.torch.load_file (lazy mmap, no byte read)", peer_st_torch_lazy, need_torch),
    ("torch pinned copy", peer_torch_pinned, need_cuda),
]


def nbytes(d) -> int:
    total = 0
    for v in d.values():
        total += v.nbytes if hasattr(v, "nbytes") else v.numel() * v.element_size()
    return total


def run_peer(fn, files, repeat, cold, drop_method):
    runs = []
    for _ in range(repeat):
        if cold:
            drop_method[0] = drop_caches(files)
        else:
            read_all(files)
        gc.collect()
        t0 = time.perf_counter()
        d = fn(files)
        dt = time.perf_counter() - t0
        n = nbytes(d)
        del d
        gc.collect()
        runs.append({"seconds": dt, "gbps": n / dt / 1e9, "bytes": n})
    gb = sorted(r["gbps"] for r in runs)
    med = gb[len(gb) // 2] if len(gb) % 2 else (gb[len(gb) // 2 - 1] + gb[len(gb) // 2]) / 2
    return {"best_gbps": gb[-1], "median_gbps": med, "runs": runs}


# ---------------------------------------------------------------- report


def combined_table(pin: dict, peers: dict) -> str:
    r = pin.get("results", {})
    rows = []

    def add(name, cold=None, warm=None, note=""):
        rows.append((name, cold, warm, note))

    fio = r.get("fio", {})
    fio_names = {
        "iodepth32": "fio direct read, bs 2M, iodepth 32",
        "iodepth1": "fio direct read, bs 2M, iodepth 1",
        "parallel": "fio direct read, bs 2M, 4 jobs x iodepth 8",
        "iodepth32_hugebuf": "fio direct read, bs 2M, iodepth 32, huge-page buffers",
        "iodepth1_hugebuf": "fio direct read, bs 2M, iodepth 1, huge-page buffers",
    }
    for k, label in fio_names.items():
        if k in fio:
            best = fio[k]["best_gbps"]
            if best == fio.get("best_gbps"):
                label += " (**fio best**)"
            add(label, best, None, f"median {fio[k]['median_gbps']:.2f}, {len(fio[k]['runs'])} runs")
    if "memcpy" in r:
        m = r["memcpy"]
        best = max(m["multi_gbps"], m["single_gbps"])
        add(f"memcpy, {m['multi_threads']} threads" + (" (**memcpy best**)" if m["multi_gbps"] == best else ""),
            None, m["multi_gbps"], "512 MiB, best of 3")
        add("memcpy, 1 thread" + (" (**memcpy best**)" if m["multi_gbps"] != best else ""), None,
            m["single_gbps"], "512 MiB, best of 3")
    if "buffered_read" in r:
        b = r["buffered_read"]
        add("read(), 1 thread, 1 MiB buffer", b["cold_gbps"], b["warm_gbps"])
    o = pin.get("options", {})
    cfg = f"{o.get('threads')} threads, {o.get('block_size', 0) >> 20} MiB, direct {o.get('direct')}"
    pc, pw = r.get("pinload_cold"), r.get("pinload_warm")
    if pc:
        fresh = [x for x in pc["runs"] if x.get("fresh_pool")]
        if fresh:
            add(f"**pinload** cold, first load into a fresh pool ({cfg})", fresh[0]["gbps"], None, "1 run")
        add(f"**pinload** re-load after unload ({cfg})", pc["reused_pool_best_gbps"],
            pw["best_gbps"] if pw else None,
            f"median {pc['reused_pool_median_gbps']:.2f} / {pw['median_gbps']:.2f}" if pw else "")
    if "pool_reserve" in r:
        pr = r["pool_reserve"]
        add("fresh pool alone: reserve" + (" + mlock" if pr.get("locked") else "") + " + touch (no I/O)", None, None,
            f"{pr['gbps']:.2f} GB/s ({pr['reserve_seconds'] + pr['first_touch_seconds']:.1f} s for "
            f"{pr['reserved_bytes'] / 1e9:.2f} GB, after {pr.get('settle_seconds', 0)} s idle)")
    for name, res in peers.items():
        if "skipped" in res:
            add(name, None, None, "skipped: " + res["skipped"])
        else:
            add(name, res["cold"]["best_gbps"], res["warm"]["best_gbps"],
                f"median {res['cold']['median_gbps']:.2f} / {res['warm']['median_gbps']:.2f}")

    def f(x):
        return "" if x is None else f"{x:.2f}"

    lines = ["| measurement | cold GB/s | warm GB/s | notes |", "|---|---:|---:|---|"]
    for name, c, w, note in rows:
        lines.append(f"| {name} | {f(c)} | {f(w)} | {note} |")
    if pc:
        lines.append("")
        pcb = pc["reused_pool_best_gbps"]
        for name, res in peers.items():
            if "skipped" in res or "lazy" in name:
                continue
            pcm = pc["reused_pool_median_gbps"]
            line = (f"- pinload / {name}: cold {pcb / res['cold']['best_gbps']:.2f}x best, "
                    f"{pcm / res['cold']['median_gbps']:.2f}x median")
            if pw:
                line += (f"; warm {pw['best_gbps'] / res['warm']['best_gbps']:.2f}x best, "
                         f"{pw['median_gbps'] / res['warm']['median_gbps']:.2f}x median")
            lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--pinload-json", default=None, help="pinload-bench --json output of the same files")
    ap.add_argument("--peers", default=None, help="comma list of peer names (substring match) to run")
    ap.add_argument("--report-only", default=None, metavar="PEERS_JSON",
                    help="run nothing: print the combined table of --pinload-json and this run_peers JSON")
    a = ap.parse_args(argv)
    if a.report_only:
        with open(a.report_only) as f:
            peers = json.load(f)["peers"]
        with open(a.pinload_json) as f:
            print(combined_table(json.load(f), peers))
        return 0

    files = resolve(a.paths)
    if not files:
        ap.error("no .safetensors file found")
    total = sum(os.path.getsize(p) for p in files)
    print(f"run_peers: {len(files)} file(s), {total / 1e9:.3f} GB", file=sys.stderr)
    drop_method = ["none"]
    load_start = os.getloadavg()
    results = {}
    for name, fn, need in PEERS:
        if a.peers and not any(s.strip() in name for s in a.peers.split(",")):
            continue
        try:
            need(files)
        except ImportError as e:
            msg = str(e) or type(e).__name__
            print(f"[{name}] skipped: {msg}", file=sys.stderr)
            results[name] = {"skipped": msg}
            continue
        print(f"[{name}]", file=sys.stderr)
        cold = run_peer(fn, files, a.repeat, True, drop_method)
        print(f"  cold best {cold['best_gbps']:.2f} GB/s, median {cold['median_gbps']:.2f}", file=sys.stderr)
        warm = run_peer(fn, files, a.repeat, False, drop_method)
        print(f"  warm best {warm['best_gbps']:.2f} GB/s, median {warm['median_gbps']:.2f}", file=sys.stderr)
        results[name] = {"cold": cold, "warm": warm}

    versions = {"python": platform.python_version()}
    for mod in ("numpy", "safetensors", "ml_dtypes", "torch"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    out = {
        "tool": "run_peers",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cores": os.cpu_count(), "kernel": platform.release(),
                 "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "versions": versions,
        "paths": a.paths,
        "files": [{"path": p, "bytes": os.path.getsize(p)} for p in files],
        "file_bytes": total,
        "repeat": a.repeat,
        "drop_cache_method": drop_method[0],
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
        print(combined_table(pin, results))
    else:
        for name, res in results.items():
            if "skipped" in res:
                print(f"{name:32s} skipped: {res['skipped']}")
            else:
                print(f"{name:32s} cold {res['cold']['best_gbps']:6.2f} GB/s  warm {res['warm']['best_gbps']:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
