"""The checkpoint a benchmark loads: its files, their headers, and the reference digests.

resolve() finds the .safetensors files that a path names the way pinload-bench does
(a file, a *.safetensors.index.json, a model folder, a diffusers pipeline folder);
reference_digests() reads a few tensors per file with os.pread, independently of every
system, so that verify() (worker.py) can check what a system returned.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct


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
