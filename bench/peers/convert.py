"""Copies of a checkpoint in the formats some peers need (tensorizer, .pt, flashpack).

Written once, never timed, in a process of their own (the state dict does not stay in
the caller's memory); kept while a stamp of the sources says they are current.
"""
from __future__ import annotations

import json
import os
import sys
import time

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def convert(files: list[str], fmt: str, out_path: str) -> dict:
    """Write the tensors of `files` as one file of another format (keys "i/name");
    done once, never timed. Kept when a stamp of the sources says it is current."""
    stamp = json.dumps([[p, os.path.getsize(p), int(os.path.getmtime(p))] for p in files])
    if os.path.exists(out_path) and _read(out_path + ".stamp") == stamp:
        return {"path": out_path, "bytes": os.path.getsize(out_path), "converted": False}
    import subprocess
    t0 = time.monotonic()
    code = ("import sys, json; sys.path.insert(0, %r); from peers.convert import convert_in_process; "
            "convert_in_process(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])" % _BENCH)
    subprocess.run([sys.executable, "-c", code, json.dumps(files), fmt, out_path], check=True)
    with open(out_path + ".stamp", "w") as f:
        f.write(stamp)
    return {"path": out_path, "bytes": os.path.getsize(out_path), "converted": True,
            "seconds": time.monotonic() - t0}


def convert_in_process(files, fmt, out_path):
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
