"""The peer adapters: one function per loader, fn(ctx) -> {key: tensor}.

Every system runs in a worker process of its own (worker.py), so that its peak RSS
(VmHWM) is its own, a cgroup can hold it, and /proc/<pid>/io shows its reads. Keys are
"i/name" (i: index of the file in the resolved list) or whatever the system names them;
verify() finds the reference tensors under "i/name", "name" or "component/name".

To add a peer: write sys_<name>(ctx) here (import the library inside it, raise Skip
with the reason where it cannot run) and add one System row to SYSTEMS.
"""
from __future__ import annotations

import mmap
from typing import Callable, NamedTuple

from .checkpoint import batches_without_clashes, header


class Skip(Exception):
    """The system cannot run here; the message says why (recorded, never silent)."""


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


def sys_pinload_per_file(ctx):
    """pinload.torch.load_file, one call per file: the drop-in for safetensors' load_file loop."""
    import pinload.torch as pt
    opts = dict(ctx.options.get("pinload", {}))
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in pt.load_file(p, device=ctx.device, **opts).items():
            out[f"{i}/{k}"] = v
    return out


def sys_pinload_batch(ctx):
    """pinload.torch.load_files_batch: every file in one call, one state dict each."""
    import pinload.torch as pt
    if not hasattr(pt, "load_files_batch"):
        raise Skip("this pinload has no load_files_batch")
    opts = dict(ctx.options.get("pinload", {}))
    out = {}
    got = pt.load_files_batch(list(ctx.files), device=ctx.device, **opts)
    for i, p in enumerate(ctx.files):
        for k, v in got[p].items():
            out[f"{i}/{k}"] = v
    return out


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


def sys_st_mmap_touch(ctx):
    """safetensors.torch.load_file (mmap backend), then one read per 4 KiB page of every tensor:
    the tensors stay views of the mapping (no copy), with every byte resident in the process. On a
    device, load_file copies."""
    from safetensors.torch import load_file
    import torch
    out = {}
    for i, p in enumerate(ctx.files):
        for k, v in load_file(p, device=ctx.device).items():
            if not ctx.on_device() and v.numel():
                b = v.reshape(-1).view(torch.uint8)
                b[::4096].sum()
                b[-1:].sum()
            out[f"{i}/{k}"] = v
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


class System(NamedTuple):
    load: Callable  # fn(ctx) -> {key: tensor}
    package: str  # whose version the results report
    on_devices: bool  # runs to a GPU too
    lazy: bool  # a map, not a load: shown for reference


SYSTEMS = {
    "pinload": System(sys_pinload, "pinload", True, False),
    "pinload ModelCache": System(sys_pinload_cache, "pinload", True, False),
    "pinload load_file": System(sys_pinload_per_file, "pinload", True, False),
    "pinload load_files_batch": System(sys_pinload_batch, "pinload", True, False),
    "safetensors mmap": System(sys_st_mmap_touch, "safetensors", True, False),
    "safetensors mmap + clone": System(sys_st_mmap_clone, "safetensors", True, False),
    "safetensors pread": System(sys_st_pread, "safetensors", True, False),
    # The same calls under another safetensors (bench/fresh_bench.py puts 0.9 first on PYTHONPATH).
    "safetensors 0.9 mmap": System(sys_st_mmap_touch, "safetensors", True, False),
    "safetensors 0.9 pread": System(sys_st_pread, "safetensors", True, False),
    "fastsafetensors": System(sys_fastsafetensors, "fastsafetensors", True, False),
    "runai-model-streamer": System(sys_runai, "runai-model-streamer", True, False),
    "instanttensor": System(sys_instanttensor, "instanttensor", True, False),
    "tensorizer": System(sys_tensorizer, "tensorizer", True, False),
    "torch.load mmap + clone": System(sys_torch_load_mmap, "torch", True, False),
    "torch.load": System(sys_torch_load, "torch", True, False),
    "flashpack": System(sys_flashpack, "flashpack", True, False),
    "safetensors.numpy.load_file": System(sys_st_numpy, "safetensors", False, False),
    "safetensors.safe_open(numpy)": System(sys_safe_open_numpy, "safetensors", False, False),
    "mmap + numpy copy": System(sys_mmap_copy, "numpy", False, False),
    "safetensors lazy mmap (not a load)": System(sys_st_lazy, "safetensors", False, True),
}
# what run_peers.py runs by default (pinload has its own bench; ModelCache is for switching)
DEFAULT_PEERS = [n for n in SYSTEMS if not n.startswith("pinload") and n not in (
    "safetensors mmap", "safetensors 0.9 mmap", "safetensors 0.9 pread")]
