"""Independent safetensors helpers for the CLI tests.

Two writers that share no code with pinload: Python's `safetensors` package
(for the dtypes numpy has) and `write_raw`, a small hand-written one built on
json + struct (for BF16, F8_*, F4, F6_*, ... that numpy lacks). Plus the
expected output of `pinload load --digest`, computed with hashlib over the
bytes that safetensors.safe_open reads, or over a slice of the raw file.
"""

import hashlib
import json
import random
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

# Element size in bits of every dtype of the format.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64,
    "F16": 16, "BF16": 16, "F32": 32, "F64": 64, "C64": 64,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
ALL_DTYPES = sorted(DTYPE_BITS)

# The dtypes that safetensors.numpy writes and safe_open(framework="numpy") reads.
NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
}


def nbytes(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    bits = n * DTYPE_BITS[dtype]
    assert bits % 8 == 0, (dtype, shape)
    return bits // 8


def raw_bytes(header: bytes, data: bytes = b"", length=None) -> bytes:
    """8-byte little-endian length, header, data: no checks at all."""
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def write_raw(path, tensors, metadata=None, pad=8, json_order=None):
    """Writes `tensors` [(name, dtype, shape, data_bytes)] laid out in list order.

    The JSON members appear in `json_order` (a permutation of indices) when
    given; the header is padded with spaces so that the data starts at a
    multiple of `pad`.
    """
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    entries, offset, data = [], 0, bytearray()
    for name, dtype, shape, payload in tensors:
        assert len(payload) == nbytes(dtype, shape), name
        entries.append((name, {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(payload)]}))
        offset += len(payload)
        data += payload
    for i in json_order if json_order is not None else range(len(entries)):
        header[entries[i][0]] = entries[i][1]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if pad > 1:
        text += b" " * ((pad - (8 + len(text)) % pad) % pad)
    Path(path).write_bytes(raw_bytes(text, bytes(data)))


def read_header(path):
    """(header dict, header length) of a file, parsed with Python's json."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n].decode("utf-8")), n


def file_order(header):
    """Tensor names in pinload's file order: by (begin, end, name)."""
    items = [(v["data_offsets"], k.encode(), k) for k, v in header.items() if k != "__metadata__"]
    return [k for _, _, k in sorted(items)]


def shape_text(shape):
    return "[" + ",".join(str(d) for d in shape) + "]"


def printable(text):
    """The CLI's escaping of names, metadata and paths (Note [Printable text] in src/cli/command.h),
    written again from its documentation: a backslash doubled; control bytes, C1 controls and bytes
    outside valid UTF-8 as \\xNN."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    out, i = [], 0
    while i < len(data):
        c = data[i]
        if c == 0x5C:
            out.append("\\\\")
            i += 1
            continue
        length = 1 if c < 0x80 else 2 if c >> 5 == 6 else 3 if c >> 4 == 14 else 4 if c >> 3 == 30 else 0
        try:
            ch = data[i:i + length].decode("utf-8") if length and i + length <= len(data) else None
        except UnicodeDecodeError:
            ch = None
        if ch is None or ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F:
            out.append(f"\\x{c:02x}")
            i += 1
            continue
        out.append(ch)
        i += length
    return "".join(out)


def expected_digest(path, prefix=""):
    """The lines `pinload load --digest path` must print for one file.

    Bytes come from safe_open(framework="numpy") for the dtypes numpy has and
    from a slice of the raw file otherwise.
    """
    header, n = read_header(path)
    raw = Path(path).read_bytes()
    lines = []
    with safe_open(str(path), framework="numpy") as f:
        for name in file_order(header):
            info = header[name]
            if info["dtype"] in NUMPY_DTYPES:
                data = f.get_tensor(name).tobytes()
            else:
                begin, end = info["data_offsets"]
                data = raw[8 + n + begin : 8 + n + end]
            assert len(data) == info["data_offsets"][1] - info["data_offsets"][0]
            digest = hashlib.sha256(data).hexdigest()
            lines.append(f"{printable(prefix + name)}\t{info['dtype']}\t{shape_text(info['shape'])}\t{digest}")
    return lines


def random_shape(rng, dtype, max_numel=512):
    rank = rng.randrange(0, 5)
    shape = []
    for _ in range(rank):
        shape.append(0 if rng.random() < 0.08 else rng.randrange(1, 9))
        if np.prod(shape) > max_numel:
            shape[-1] = 1
    if DTYPE_BITS[dtype] < 8:
        shape.append(2 if DTYPE_BITS[dtype] == 4 else 4)  # a whole number of bytes
    return shape


def random_name(rng, i):
    stem = rng.choice(["model.layers", "encoder.block", "w\u00fcrfel", "emb", "a b"])
    return f"{stem}.{i}.{rng.choice(['weight', 'bias', 'scale'])}"


def write_random_numpy(path, rng, count):
    """A random checkpoint written by safetensors.numpy.save_file."""
    arrays = {}
    for i in range(count):
        dtype = rng.choice(sorted(NUMPY_DTYPES))
        shape = random_shape(rng, dtype)
        np_dtype = NUMPY_DTYPES[dtype]
        size = int(np.prod(shape)) if shape else 1
        raw = np.frombuffer(rng.randbytes(size * np.dtype(np_dtype).itemsize), dtype=np.uint8)
        if dtype == "BOOL":
            arr = (raw % 2).astype(np.bool_)
        else:
            arr = raw.view(np_dtype)
        arrays[random_name(rng, i)] = arr.reshape(shape)
    metadata = {"format": "np", "seed": str(rng.random())} if rng.random() < 0.5 else None
    save_file(arrays, str(path), metadata=metadata)


def write_random_raw(path, rng, count):
    """A random checkpoint of any dtypes, written by hand in shuffled JSON order."""
    tensors = []
    for i in range(count):
        dtype = rng.choice(ALL_DTYPES)
        shape = random_shape(rng, dtype)
        tensors.append((random_name(rng, i), dtype, shape, rng.randbytes(nbytes(dtype, shape))))
    order = list(range(count))
    rng.shuffle(order)
    metadata = {"writer": "stfiles", "n": str(count)} if rng.random() < 0.5 else None
    write_raw(path, tensors, metadata=metadata, pad=rng.choice([1, 8]), json_order=order)


def reference_accepts(path):
    """(True, None) if safetensors.safe_open opens the file, else (False, message)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
        return True, None
    except Exception as e:  # noqa: BLE001 - the reference raises several types
        return False, str(e)


def seeded(seed):
    return random.Random(seed)
