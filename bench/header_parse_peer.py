#!/usr/bin/env python3
"""Header parsing at scale: pinload against the reference safetensors on one synthetic header.

Writes the header of bench/micro_bench.cc's make_header(n) (BF16 tensors with FLUX-like names,
"__metadata__" first) as a file with a zero-filled sparse data section, then times, best of
--repeat, in this one process:
  - safetensors.safe_open(path, "np") and .keys()      (the reference: serde_json in Rust)
  - pinload._core.read_header(path)                    (open, read, parse_header, to Python)
and `pinload inspect --json` (parse plus JSON output) when --pinload is given. Prints one JSON
object; the ratio is reference / pinload (above 1: pinload faster).

  PYTHONPATH=build/python:python python3 bench/header_parse_peer.py --tensors 200000 --pinload build/pinload
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

KINDS = ["attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.0.bias",
         "ff.net.0.proj.weight", "ff.net.2.weight", "norm1.linear.weight", "attn.norm_q.weight"]


def make_header(n):
    tensors = []
    for i in range(n):
        shape = [3072] if i % 8 in (3, 7) else [3072, 3072]
        tensors.append((f"transformer_blocks.{i // 8}.{KINDS[i % 8]}", shape))
    tensors.sort()
    parts, off = ['{"__metadata__":{"format":"pt"}'], 0
    for name, shape in tensors:
        nbytes = 2
        for d in shape:
            nbytes *= d
        parts.append(f',"{name}":{{"dtype":"BF16","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{off},{off + nbytes}]}}')
        off += nbytes
    text = ("".join(parts) + "}").encode()
    text += b" " * (-len(text) % 8)
    return text, off


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pinload", help="the pinload binary, to time `pinload inspect --json` too")
    args = ap.parse_args()
    from safetensors import safe_open
    import pinload._core as core

    header, data_bytes = make_header(args.tensors)
    with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_bytes)  # sparse: only the header is read
        path = f.name
    try:
        def reference():
            with safe_open(path, framework="np") as g:
                assert len(g.keys()) == args.tensors

        def ours():
            assert len(core.read_header(path.encode())["tensors"]) == args.tensors

        out = {"tensors": args.tensors, "header_bytes": len(header),
               "reference_safe_open_s": best(reference, args.repeat),
               "pinload_read_header_s": best(ours, args.repeat)}
        out["ratio_read_header"] = out["reference_safe_open_s"] / out["pinload_read_header_s"]
        if args.pinload:
            out["pinload_inspect_json_s"] = best(lambda: subprocess.run([args.pinload, "inspect", "--json", path],
                                                                        stdout=subprocess.DEVNULL, check=True),
                                                 args.repeat)
        print(json.dumps(out, indent=2))
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
