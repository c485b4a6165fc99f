#!/usr/bin/env python3
"""Load the same checkpoint with the loaders people use today, each in a process of its own.

    bench/run_peers.py [--repeat N] [--json OUT] [--variant fp16] [--convert-dir DIR]
                       [--pinload-json PINLOAD.json] PATH...

PATH is what pinload-bench takes: a .safetensors file, a *.safetensors.index.json,
a model folder, or a diffusers pipeline folder (model_index.json).

Each run is a fresh worker process (this file with --worker), so that its peak RSS
(VmHWM) is its own and /proc/<pid>/io shows what it read. Systems (SYSTEMS below; one
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
import gc
import hashlib
import json
import mmap
import os
import platform
import struct
import sys
import time

# ---------------------------------------------------------------- files


def _is_variant(name: str) -> bool:
    return "." in name[: -len(".safetensors")]


def _resolve_folder(d: str, variant: str | None = None) -> list[str]:
    names = sorted(os.listdir(d))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if variant:
        vi = [n for n in indexes if n.endswith(f".{variant}.safetensors.index.json")]
        if vi:
            return _resolve_index(os.path.join(d, vi[0]))
        vf = [n for n in names if n.endswith(f".{variant}.safetensors")]
        if vf:
            return [os.path.join(d, n) for n in vf]
    indexes = [n for n in indexes if not _is_variant(n[: -len(".index.json")])]
    if indexes:
        return _resolve_index(os.path.join(d, indexes[0]))
    plain = [n for n in names if n.endswith(".safetensors") and not _is_variant(n)]
    if plain:
        return [os.path.join(d, n) for n in plain]
    # only variant files (a pipeline saved with variant="fp16" alone): take them
    return [os.path.join(d, n) for n in names if n.endswith(".safetensors")]


def _resolve_index(path: str) -> list[str]:
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    d = os.path.dirname(path)
    return [os.path.join(d, s) for s in sorted(set(weight_map.values()))]


def resolve(paths: list[str], variant: str | None = None) -> list[str]:
    """The .safetensors files that PATHs name, as pinload-bench resolves them."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            if os.path.exists(os.path.join(p, "model_index.json")):
                for sub in sorted(os.listdir(p)):
                    sd = os.path.join(p, sub)
                    if os.path.isdir(sd) and any(n.endswith(".safetensors") for n in os.listdir(sd)):
                        out += _resolve_folder(sd, variant)
            else:
                out += _resolve_folder(p, variant)
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


def data_bytes(files: list[str]) -> int:
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for p in files for t in header(p)[1].values())


def batches_without_clashes(files: list[str]) -> list[list[int]]:
    """Indices of `files` in groups whose tensor names are unique within a group
    (SDXL's two text encoders share names): loaders that return one flat dict per
    call get one call per group."""
    groups, names = [], []
    for i, p in enumerate(files):
        keys = set(header(p)[1])
        for g, n in zip(groups, names):
            if not (n & keys):
                g.append(i)
                n |= keys
                break
        else:
            groups.append([i])
            names.append(set(keys))
    return groups


def reference_digests(files: list[str], per_file: int = 3) -> dict:
    """sha1 of a few tensors per file (first, middle and last by offset), read with
    os.pread straight from the file: the independent reference for every system."""
    out = {}
    for i, p in enumerate(files):
        start, h = header(p)
        by_off = sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0])
        pick = {0, len(by_off) // 2, len(by_off) - 1} if per_file >= 3 else {0}
        fd = os.open(p, os.O_RDONLY)
        try:
            for j in sorted(pick):
                name, t = by_off[j]
                b, e = t["data_offsets"]
                out[f"{i}/{name}"] = hashlib.sha1(os.pread(fd, e - b, start + b)).hexdigest()
        finally:
            os.close(fd)
    return out


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
    evict(files)
    return "fadvise_dontneed"


def evict(files: list[str]) -> str:
    """Drop these files' pages from the page cache (and only these: a global
    drop_caches would also evict torch's libraries, so that every worker's imports
    read a gigabyte from disk first)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed (the set's files)"


def cached_bytes(files: list[str]) -> int | None:
    """Bytes of these files in the page cache (util-linux fincore), None without it."""
    import shutil
    import subprocess
    if not shutil.which("fincore"):
        return None
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                       capture_output=True, text=True)
    try:
        return sum(int(x) for x in r.stdout.split())
    except ValueError:
        return None


def read_all(files: list[str]):
    buf = bytearray(1 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ---------------------------------------------------------------- systems
#
# Every system runs in a worker process of its own (run_worker below), so that its
# peak RSS (VmHWM) is its own, a cgroup can hold it, and /proc/<pid>/io shows its
# reads. A system is fn(ctx) -> {key: tensor}; keys are "i/name" (i: index of the
# file in the resolved list) or whatever the system names them; verify() finds the
# reference tensors under "i/name", "name" or "component/name".


class Ctx:
    """What a system gets: the user's paths, the resolved files, the device,
    converted files (tensorizer, .pt, flashpack) and options."""

    def __init__(self, spec: dict, files: list[str]):
        self.paths = spec["paths"]
        self.files = files
        self.device = spec.get("device", "cpu")
        self.variant = spec.get("variant")
        self.converted = spec.get("converted", {})
        self.options = spec.get("options", {})
        self.state = {}  # kept across the steps of one worker (pinload's ModelCache)

    def on_device(self) -> bool:
        return self.device != "cpu"


def sys_pinload(ctx):
    import pinload
    opts = dict(ctx.options.get("pinload", {}))
    if ctx.variant:
        opts["variant"] = ctx.variant
    return pinload.load_files(list(ctx.paths), device=ctx.device, **opts)


def sys_pinload_cache(ctx):
    """pinload.ModelCache, where the library has it (feature-detected: added in parallel).
    A variant is a cache-wide option there, so a set with a variant (SDXL's fp16) gets a
    cache of its own; all of them hold their copies in the same pool."""
    import pinload
    if not hasattr(pinload, "ModelCache"):
        raise Skip("this pinload has no ModelCache")
    caches = ctx.state.setdefault("caches", {})
    cache = caches.get(ctx.variant)
    if cache is None:
        opts = dict(ctx.options.get("pinload", {}))
        if ctx.variant:
            opts["variant"] = ctx.variant
        pool = ctx.device if ctx.on_device() else "cpu"
        cache = caches[ctx.variant] = pinload.ModelCache(ctx.options.get("cache_budget", 16 << 30),
                                                          pool_device=pool, **opts)
    d = cache.get(list(ctx.paths), device=ctx.device)
    ctx.state["note"] = f"cache stats {cache.stats()}" if hasattr(cache, "stats") else ""
    return d


def sys_st_mmap_clone(ctx):
    # mmap, then a private copy of every tensor: what a user holds once the bytes
    # are in process memory (load_state_dict's copy). On a device, load_file copies.
    from safetensors.torch import load_file
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in load_file(p, device=ctx.device).items():
            out[f"{i}/{k}"] = v if ctx.on_device() else v.clone()
    return out


def sys_st_pread(ctx):
    from safetensors.torch import load_file
    import inspect
    if "backend" not in inspect.signature(load_file).parameters:
        raise Skip("this safetensors has no backend= (pread arrived in 0.8)")
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in load_file(p, device=ctx.device, backend="pread").items():
            out[f"{i}/{k}"] = v
    return out


def sys_st_lazy(ctx):
    from safetensors.torch import load_file
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in load_file(p, device=ctx.device).items():
            out[f"{i}/{k}"] = v
    return out


def _by_batch(ctx, load_batch):
    """load_batch(list of files) -> iterable of (name, tensor); names mapped back to "i/name"."""
    out = {}
    for group in batches_without_clashes(ctx.files):
        owner = {}
        for i in group:
            for k in header(ctx.files[i])[1]:
                owner[k] = i
        for k, v in load_batch([ctx.files[i] for i in group]):
            out[f"{owner[k]}/{k}"] = v
    return out


def sys_fastsafetensors(ctx):
    from fastsafetensors import fastsafe_open
    import fastsafetensors
    nogds = not ctx.on_device() or ctx.options.get("fastsafetensors_nogds", True)

    def batch(fs):
        with fastsafe_open(fs, framework="pt", device=ctx.device, nogds=nogds) as f:
            return [(k, f.get_tensor(k)) for k in f.keys()]
    ctx.state["note"] = f"fastsafetensors {fastsafetensors.__version__}, nogds={nogds}"
    return _by_batch(ctx, batch)


def sys_runai(ctx):
    from runai_model_streamer import SafetensorsStreamer

    def batch(fs):
        with SafetensorsStreamer() as s:
            s.stream_files(fs, device=ctx.device)
            return list(s.get_tensors())
    return _by_batch(ctx, batch)


def sys_instanttensor(ctx):
    from instanttensor import safe_open

    def batch(fs):
        with safe_open(fs, framework="pt", device=ctx.device) as f:
            return [(k, f.get_tensor(k)) for k in f.keys()]
    try:
        return _by_batch(ctx, batch)
    except ValueError as e:
        if not ctx.on_device():
            raise Skip(f"GPU only: its safe_open says \"{e}\"")
        raise


def _converted(ctx, fmt):
    p = ctx.converted.get(fmt)
    if not p:
        raise Skip(ctx.options.get("convert_skip", {}).get(fmt, f"no {fmt} file converted for this set"))
    return p


def sys_tensorizer(ctx):
    from tensorizer import TensorDeserializer
    path = _converted(ctx, "tensorizer")
    with TensorDeserializer(path, device=ctx.device, lazy_load=False) as d:
        return dict(d.items())


def sys_torch_load_mmap(ctx):
    import torch
    sd = torch.load(_converted(ctx, "pt"), mmap=True, weights_only=True, map_location="cpu")
    return {k: (v.to(ctx.device) if ctx.on_device() else v.clone()) for k, v in sd.items()}


def sys_torch_load(ctx):
    import torch
    return torch.load(_converted(ctx, "pt"), weights_only=True, map_location=ctx.device)


def sys_flashpack(ctx):
    from flashpack.deserialization import iterate_from_flash_tensor, read_flashpack_file
    storage, meta = read_flashpack_file(_converted(ctx, "flashpack"), device=ctx.device)
    return dict(iterate_from_flash_tensor(storage, meta))


def sys_st_numpy(ctx):
    from safetensors.numpy import load_file
    _need_numpy_bf16(ctx.files)
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in load_file(p).items():
            out[f"{i}/{k}"] = v
    return out


def sys_safe_open_numpy(ctx):
    from safetensors import safe_open
    _need_numpy_bf16(ctx.files)
    out = {}
    for i, p in enumerate(ctx.files):
        with safe_open(p, framework="numpy") as f:
            for k in f.keys():
                out[f"{i}/{k}"] = f.get_tensor(k)
    return out


def sys_mmap_copy(ctx):
    import numpy as np
    out = {}
    for i, p in enumerate(ctx.files):
        start, h = header(p)
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for k, t in h.items():
                b, e = t["data_offsets"]
                out[f"{i}/{k}"] = np.frombuffer(mm, dtype=np.uint8, count=e - b, offset=start + b).copy()
        finally:
            mm.close()
    return out


def _need_numpy_bf16(files):
    if any(t["dtype"] == "BF16" for p in files for t in header(p)[1].values()):
        try:
            import ml_dtypes  # noqa: F401  (registers numpy's bfloat16)
        except ImportError:
            raise Skip("BF16 tensors need ml_dtypes for numpy (pip install ml_dtypes)")


class Skip(Exception):
    """The system cannot run here; the message says why (recorded, never silent)."""


# name: (function, package to report the version of, on devices?, lazy: a map, not a load)
SYSTEMS = {
    "pinload": (sys_pinload, "pinload", True, False),
    "pinload ModelCache": (sys_pinload_cache, "pinload", True, False),
    "safetensors mmap + clone": (sys_st_mmap_clone, "safetensors", True, False),
    "safetensors pread": (sys_st_pread, "safetensors", True, False),
    "fastsafetensors": (sys_fastsafetensors, "fastsafetensors", True, False),
    "runai-model-streamer": (sys_runai, "runai-model-streamer", True, False),
    "instanttensor": (sys_instanttensor, "instanttensor", True, False),
    "tensorizer": (sys_tensorizer, "tensorizer", True, False),
    "torch.load mmap + clone": (sys_torch_load_mmap, "torch", True, False),
    "torch.load": (sys_torch_load, "torch", True, False),
    "flashpack": (sys_flashpack, "flashpack", True, False),
    "safetensors.numpy.load_file": (sys_st_numpy, "safetensors", False, False),
    "safetensors.safe_open(numpy)": (sys_safe_open_numpy, "safetensors", False, False),
    "mmap + numpy copy": (sys_mmap_copy, "numpy", False, False),
    "safetensors lazy mmap (not a load)": (sys_st_lazy, "safetensors", False, True),
}
# what run_peers.py runs by default (pinload has its own bench; ModelCache is for switching)
DEFAULT_PEERS = [n for n in SYSTEMS if not n.startswith("pinload")]


# ---------------------------------------------------------------- the worker


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _tensor_bytes(v) -> bytes:
    if hasattr(v, "numel"):  # torch
        import torch
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return v.tobytes()


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if hasattr(v, "numel") else v.nbytes


def verify(d: dict, files: list[str], ref: dict) -> dict:
    """Every tensor there (count and bytes) and the reference tensors byte-equal."""
    want_n = sum(len(header(p)[1]) for p in files)
    want_b = data_bytes(files)
    got_b = sum(_nbytes(v) for v in d.values())
    bad, missing = [], []
    for key, digest in ref.items():
        i, name = key.split("/", 1)
        comp = os.path.basename(os.path.dirname(files[int(i)]))
        v = next((d[k] for k in (key, name, f"{comp}/{name}") if k in d), None)
        if v is None:
            missing.append(key)
        elif hashlib.sha1(_tensor_bytes(v)).hexdigest() != digest:
            bad.append(key)
    ok = len(d) == want_n and got_b == want_b and not bad and not missing
    return {"ok": ok, "tensors": len(d), "expect_tensors": want_n, "bytes": got_b, "expect_bytes": want_b,
            "digests_checked": len(ref), "digest_mismatch": bad[:5], "missing": missing[:5]}


def _sync(device):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def run_worker(spec_path: str) -> int:
    """Load spec["steps"] (lists of paths) one after the other, each timed; the
    previous step's tensors are dropped before the next (a pipeline switch)."""
    with open(spec_path) as f:
        spec = json.load(f)
    out = {"system": spec["system"], "pid": os.getpid(), "steps": []}
    t_imp = time.monotonic()
    fn, pkg, _, lazy = SYSTEMS[spec["system"]]
    out["status_start"] = _status()
    try:
        if spec["system"].startswith("pinload"):
            import pinload
            out["version"] = pinload.__version__
        else:
            import importlib.metadata as md
            out["version"] = md.version(pkg)
        if spec.get("device", "cpu") != "cpu" or spec["system"] not in ("mmap + numpy copy",):
            import torch  # noqa: F401  (the import is not part of any load)
    except Exception as e:  # noqa: BLE001
        out["skipped"] = f"import: {type(e).__name__}: {e}"
    out["import_seconds"] = time.monotonic() - t_imp
    out["status_imported"] = _status()
    held = None
    ctx = None
    for si, step in enumerate(spec["steps"] if "skipped" not in out else []):
        files = step["files"]
        sspec = dict(spec, paths=step["paths"], variant=step.get("variant"), converted=step.get("converted", {}))
        c2 = Ctx(sspec, files)
        if ctx is not None:
            c2.state = ctx.state
        ctx = c2
        if step.get("drop_caches"):
            evict(files)
        held = None
        gc.collect()
        before = _status()
        rec = {"label": step.get("label", str(si)), "bytes_expected": data_bytes(files)}
        t0 = time.monotonic()
        rec["t0"] = t0
        try:
            d = fn(ctx)
            _sync(ctx.device)
        except Skip as e:
            out["skipped"] = str(e)
            break
        except Exception as e:  # noqa: BLE001
            import traceback
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc()[-2000:]
            break
        t1 = time.monotonic()
        after = _status()
        rec.update(t1=t1, seconds=t1 - t0)
        rec["gbps"] = rec["bytes_expected"] / rec["seconds"] / 1e9
        rec["anon_gain"] = (after.get("RssAnon", 0) + after.get("RssShmem", 0)
                            - before.get("RssAnon", 0) - before.get("RssShmem", 0))
        rec["status_after"] = after
        rec["verify"] = verify(d, files, step.get("digests", {}))
        # a lazy map shows as a load that left almost nothing resident in process memory
        if not ctx.on_device() and si == 0:
            rec["resident"] = rec["anon_gain"] >= 0.9 * rec["bytes_expected"]
            if not rec["resident"]:
                rec["verify"]["ok"] = False
                rec["verify"]["lazy"] = (f"only {rec['anon_gain'] / 1e9:.3f} GB of "
                                         f"{rec['bytes_expected'] / 1e9:.3f} GB became resident")
        if "note" in ctx.state:
            rec["note"] = ctx.state["note"]
        out["steps"].append(rec)
        held = d  # noqa: F841  (held until the next step: a pipeline keeps one model)
        del d
    out["lazy"] = lazy
    out["status_end"] = _status()
    out["vmhwm"] = out["status_end"].get("VmHWM")
    with open(spec["out"], "w") as f:
        json.dump(out, f, indent=1)
    return 0


# ---------------------------------------------------------------- the parent side


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
               env: dict | None = None) -> dict:
    """Run one system in a worker process: drop the page cache first (cold) or read
    the files once (warm), sample /proc/<pid>/io every sample_ms, hold it in a memory
    cgroup of mem_limit bytes if asked. Returns the worker's record plus the
    samples, exit status, peak RSS and the cgroup's peak."""
    import subprocess
    import tempfile
    files = [f for s in steps for f in s["files"]]
    res = {"system": name, "device": device}
    if cold:
        res["cache"] = evict(sorted(set(files)))
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
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", os.path.join(td, "spec.json")],
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


# ---------------------------------------------------------------- report


def combined_table(pin: dict, peers: dict) -> str:
    r = pin.get("results", {})
    rows = []

    def add(name, cold=None, warm=None, note=""):
        rows.append((name, cold, warm, note))

    fio = r.get("fio", {})
    # Every fio variant pinload-bench ran, with the title it gave it.
    for k, v in fio.items():
        if not isinstance(v, dict) or "best_gbps" not in v:
            continue
        label = v.get("title", f"fio {k}")
        if v["best_gbps"] == fio.get("best_gbps"):
            label += " (**fio best**)"
        add(label, v["best_gbps"], None, f"median {v['median_gbps']:.2f}, {len(v['runs'])} runs")
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


def convert(files: list[str], fmt: str, out_path: str) -> dict:
    """Write the tensors of `files` as one file of another format (keys "i/name");
    done once, never timed. Kept when a stamp of the sources says it is current."""
    stamp = json.dumps([[p, os.path.getsize(p), int(os.path.getmtime(p))] for p in files])
    if os.path.exists(out_path) and _read(out_path + ".stamp") == stamp:
        return {"path": out_path, "bytes": os.path.getsize(out_path), "converted": False}
    import subprocess
    t0 = time.monotonic()
    code = ("import sys, json; sys.path.insert(0, %r); import run_peers as r; "
            "r._convert_in_process(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])" % os.path.dirname(__file__))
    subprocess.run([sys.executable, "-c", code, json.dumps(files), fmt, out_path], check=True)
    with open(out_path + ".stamp", "w") as f:
        f.write(stamp)
    return {"path": out_path, "bytes": os.path.getsize(out_path), "converted": True,
            "seconds": time.monotonic() - t0}


def _convert_in_process(files, fmt, out_path):
    from safetensors.torch import load_file
    sd = {}
    for i, p in enumerate(files):
        for k, v in load_file(p).items():
            sd[f"{i}/{k}"] = v
    tmp = out_path + ".tmp"
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    if fmt == "tensorizer":
        from tensorizer import TensorSerializer
        s = TensorSerializer(tmp)
        s.write_state_dict(sd)
        s.close()
    elif fmt == "pt":
        import torch
        torch.save(sd, tmp)
    elif fmt == "flashpack":
        from flashpack.commands import convert_to_flashpack_from_state_dict
        convert_to_flashpack_from_state_dict(sd, tmp)
    else:
        raise ValueError(fmt)
    os.replace(tmp, out_path)


def versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for pkg in ("numpy", "safetensors", "torch", "fastsafetensors", "runai-model-streamer", "tensorizer",
                "instanttensor", "flashpack", "ml_dtypes", "diffusers", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _agg(runs):
    gb = sorted(r["gbps"] for r in runs)
    med = gb[len(gb) // 2] if len(gb) % 2 else (gb[len(gb) // 2 - 1] + gb[len(gb) // 2]) / 2
    return {"best_gbps": gb[-1], "median_gbps": med, "runs": runs}


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
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report-only", default=None, metavar="PEERS_JSON",
                    help="run nothing: print the combined table of --pinload-json and this run_peers JSON")
    a = ap.parse_args(argv)
    if a.worker:
        return run_worker(a.worker)
    if a.report_only:
        with open(a.report_only) as f:
            peers = json.load(f)["peers"]
        with open(a.pinload_json) as f:
            print(combined_table(json.load(f), peers))
        return 0
    if not a.paths:
        ap.error("PATH required")

    files = resolve(a.paths, a.variant)
    if not files:
        ap.error("no .safetensors file found")
    total = sum(os.path.getsize(p) for p in files)
    print(f"run_peers: {len(files)} file(s), {total / 1e9:.3f} GB", file=sys.stderr)
    digests = reference_digests(files)
    converted = {}
    if a.convert_dir:
        for fmt, ext in (("tensorizer", "tensors"), ("pt", "pt"), ("flashpack", "flashpack")):
            try:
                converted[fmt] = convert(files, fmt, os.path.join(a.convert_dir, f"model.{ext}"))["path"]
            except Exception as e:  # noqa: BLE001
                print(f"convert {fmt}: {e}", file=sys.stderr)
    step = {"paths": a.paths, "files": files, "variant": a.variant, "digests": digests, "converted": converted}
    load_start = os.getloadavg()
    results = {}
    names = [n for n in DEFAULT_PEERS if not a.peers or any(x.strip() in n for x in a.peers.split(","))]
    for name in names:
        rec = {}
        for phase, cold in (("cold", True), ("warm", False)):
            runs = []
            for _ in range(a.repeat):
                r = run_system(name, [step], device=a.device, cold=cold)
                print(f"[{name}] {phase}: {summary(r)}", file=sys.stderr)
                if "skipped" in r or "error" in r:
                    rec = {"skipped": r.get("skipped") or r["error"]}
                    break
                s0 = r["steps"][0]
                runs.append({"seconds": s0["seconds"], "gbps": s0["gbps"], "bytes": s0["bytes_expected"],
                             "peak_rss": r.get("vmhwm"), "verify": s0["verify"]})
            if "skipped" in rec:
                break
            rec[phase] = _agg(runs)
        results[name] = rec

    out = {
        "tool": "run_peers",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cores": os.cpu_count(), "kernel": platform.release(),
                 "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "versions": versions(),
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
        print(combined_table(pin, results))
    else:
        for name, res in results.items():
            if "skipped" in res:
                print(f"{name:36s} skipped: {res['skipped']}")
            else:
                print(f"{name:36s} cold {res['cold']['best_gbps']:6.2f} GB/s  warm {res['warm']['best_gbps']:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
