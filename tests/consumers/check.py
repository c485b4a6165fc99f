"""The consumer projects' checkpoint and their check (scripts/test-consumers.sh).

  check.py write PATH                   writes a small checkpoint of mixed dtypes and shapes
  check.py compare PATH LISTING DUMP    compares what a consumer printed (LISTING) and wrote
                                        (DUMP) with what safetensors' own reader finds in PATH

The consumers print a line per tensor in name order (name, dtype, shape, bytes; tab-separated)
and write the tensors' bytes in that order; safetensors.numpy is the independent reader.
"""

import sys

import numpy as np
from safetensors.numpy import load_file, save_file

DTYPES = {np.dtype(k): v for k, v in [("float32", "F32"), ("float16", "F16"), ("float64", "F64"), ("int64", "I64"),
                                      ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"),
                                      ("bool", "BOOL")]}


def write(path):
    rng = np.random.default_rng(39)
    tensors = {
        "embed.weight": rng.standard_normal((512, 384)).astype(np.float32),  # 768 KiB: more than one read
        "blocks.0.attn.qkv.weight": rng.standard_normal((96, 64)).astype(np.float16),
        "blocks.0.attn.qkv.bias": rng.standard_normal(96),
        "blocks.0.norm.scale": np.asarray(1.5, dtype=np.float32),  # 0-d
        "blocks.0.mask": rng.integers(0, 2, (7, 5)).astype(bool),
        "position_ids": np.arange(77, dtype=np.int64)[None, :],
        "quant.zero_point": rng.integers(-128, 128, 33).astype(np.int8),
        "quant.table": rng.integers(0, 256, (3, 11), dtype=np.uint8),
        "counts": rng.integers(-(2**31), 2**31, 9, dtype=np.int32),
        "offsets": rng.integers(-(2**15), 2**15, 5, dtype=np.int16),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    save_file(tensors, path, metadata={"format": "pt"})


def compare(path, listing_path, dump_path):
    ref = load_file(path)
    names = sorted(ref)
    want = [f"{n}\t{DTYPES[ref[n].dtype]}\t[{','.join(map(str, ref[n].shape))}]\t{ref[n].nbytes}" for n in names]
    with open(listing_path, encoding="utf-8") as f:
        got = f.read().splitlines()
    if got != want:
        sys.exit("the consumer's tensors differ from safetensors':\n" +
                 "\n".join(f"  got  {g!r}\n  want {w!r}" for g, w in zip(got + [""] * len(want), want + [""] * len(got))
                           if g != w))
    with open(dump_path, "rb") as f:
        dump = f.read()
    offset = 0
    for n in names:
        b = np.ascontiguousarray(ref[n]).tobytes()
        if dump[offset:offset + len(b)] != b:
            sys.exit(f"{n}: the consumer's bytes differ from safetensors' (at dump offset {offset})")
        offset += len(b)
    if offset != len(dump):
        sys.exit(f"the consumer wrote {len(dump)} bytes, safetensors reads {offset}")
    print(f"{len(names)} tensors, {offset} bytes: equal to safetensors' reader")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "compare":
        compare(*sys.argv[2:])
    else:
        sys.exit(__doc__)
