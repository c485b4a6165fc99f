"""The worker: one process that loads the steps of a spec with one system, times each
step, and verifies what it returned.

The harness starts it (harness.run_system) and reads its record from spec["out"].
verify() is the check every system's result must pass: the tensor count and bytes, the
reference digests (checkpoint.reference_digests), and on the CPU that the bytes became
resident process memory (a lazy map fails and is flagged).
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import time

from .adapters import SYSTEMS, Ctx, Skip
from .checkpoint import data_bytes, header
from .page_cache import evict


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
        # Pages of a mapping that the load touched are resident too (safetensors mmap, a
        # zero-copy view of the page cache); a lazy map touches none.
        rec["file_gain"] = after.get("RssFile", 0) - before.get("RssFile", 0)
        rec["status_after"] = after
        rec["verify"] = verify(d, files, step.get("digests", {}))
        # a lazy map shows as a load that left almost nothing resident in process memory
        if not ctx.on_device() and si == 0:
            gain = rec["anon_gain"] + max(rec["file_gain"], 0)
            rec["resident"] = gain >= 0.9 * rec["bytes_expected"]
            if not rec["resident"]:
                rec["verify"]["ok"] = False
                rec["verify"]["lazy"] = (f"only {gain / 1e9:.3f} GB of "
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


def main(spec_path: str) -> int:
    """The worker process's entry (harness.WORKER_COMMAND)."""
    return run_worker(spec_path)
