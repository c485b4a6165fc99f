"""Differential test: pinload accepts a file exactly when safetensors does.

Seeded mutations of valid files (header bytes flipped, lengths changed,
truncations, appended bytes) go to both `pinload inspect` and
safetensors.safe_open. They must agree, except where pinload is deliberately
stricter (docs/fuzzing.md: duplicate keys, nesting deeper than 16 levels),
and pinload must exit 0 or 1, never die of a signal. Where both accept, their
views of the file must agree too.
"""

import json
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save

import stfiles

# Bytes that matter to JSON and to the format.
INTERESTING = b'{}[]",: \t\n0123456789-+.eE_\\uABFUI\x00\x7f\x80\xc3\xff'
# Messages of the rules where pinload is stricter than the reference.
STRICTER = ("duplicate key", "nests deeper than")


def base_files():
    """A few valid files: reference-written and hand-written, with edge cases."""
    reference = save({"emb": np.arange(12, dtype=np.float16).reshape(3, 4), "bias": np.zeros(3, np.float32),
                      "n": np.array(7, np.int64), "empty": np.zeros((0, 2), np.uint8),
                      "mask": np.array([True, False, True])}, metadata={"format": "pt", "k": "10"})
    # Hand-written: dtypes numpy lacks, a zero-size tensor, unaligned offsets,
    # an unknown field, "__metadata__": null, trailing padding.
    header, offset, data = {"__metadata__": None}, 0, b""
    for name, dtype, shape, payload in [("b", "BF16", [2], b"\x80\x3f\x00\x40"), ("z", "F8_E4M3", [0], b""),
                                        ("q", "F4", [2, 2], b"\x12\x34"), ("u", "U8", [1], b"\x07"),
                                        ("f", "F32", [], b"\x00\x00\x80\x3f"), ("s", "F6_E3M2", [4], b"abc"),
                                        ("t", "I16", [1, 1], b"\x01\x00")]:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(payload)], "x": 1}
        offset += len(payload)
        data += payload
    hand = stfiles.raw_bytes(json.dumps(header, separators=(",", ":")).encode() + b"   ", data)
    minimal = stfiles.raw_bytes(b'{"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}', b"\x01\x02\x03\x04")
    return {"reference": reference, "hand": hand, "minimal": minimal}


def mutations(name, original, rng):
    """(label, bytes) pairs: seeded, deterministic."""
    (n,) = struct.unpack("<Q", original[:8])
    header_end = 8 + n
    edges = set(range(8, 10)) | set(range(header_end - 4, header_end))
    for i in range(8, header_end):  # every header byte: one value, all at the edges
        for value in INTERESTING if i in edges else [rng.choice(INTERESTING)]:
            if original[i] != value:
                yield f"{name}:flip@{i}={value:#04x}", original[:i] + bytes([value]) + original[i + 1 :]
    names = [k for k in json.loads(original[8:header_end]) if k != "__metadata__"]
    for a, b in zip(names, names[1:]):  # a tensor renamed to its neighbour's name
        header = original[8:header_end].replace(f'"{b}":'.encode(), f'"{a}":'.encode(), 1)
        yield f"{name}:rename {b}->{a}", stfiles.raw_bytes(header, original[header_end:])
    for i in rng.sample(range(8, header_end), min(20, n)):  # deletions and insertions
        yield f"{name}:del@{i}", original[:i] + original[i + 1 :]
        yield f"{name}:del+len@{i}", struct.pack("<Q", n - 1) + original[8:i] + original[i + 1 :]
        ins = bytes([rng.choice(INTERESTING)])
        yield f"{name}:ins+len@{i}", struct.pack("<Q", n + 1) + original[8:i] + ins + original[i:]
    for tail in (b" ", b"\t\r\n", b"\x00", b"\x00junk", b"x", b"}", b"{}", b",", b"\xc3\xa9", b"\xef\xbb\xbf"):
        header = original[8:header_end]  # text before or after the object, length adjusted
        yield f"{name}:tail={tail!r}", stfiles.raw_bytes(header + tail, original[header_end:])
        yield f"{name}:head={tail!r}", stfiles.raw_bytes(tail + header, original[header_end:])
    for i in range(8):  # the length prefix
        for value in (0x00, 0x01, 0x80, 0xFF):
            if original[i] != value:
                yield f"{name}:len@{i}={value:#04x}", original[:i] + bytes([value]) + original[i + 1 :]
    for delta in (-8, -1, 1, 8):
        yield f"{name}:len{delta:+d}", struct.pack("<Q", n + delta) + original[8:]
    sizes = set(rng.sample(range(len(original)), min(30, len(original))))
    for size in sorted(sizes | {0, 7, 8, header_end - 1, header_end, len(original) - 1}):
        yield f"{name}:truncate@{size}", original[:size]
    for extra in (b"\x00", b" ", b"\x00" * 8, b"junk"):
        yield f"{name}:append{len(extra)}", original + extra
    for i in range(header_end, len(original)):  # data bytes do not matter
        yield f"{name}:data@{i}", original[:i] + bytes([original[i] ^ 0xFF]) + original[i + 1 :]


def reference_view(path):
    with safe_open(str(path), framework="numpy") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}, f.metadata() or {}


def test_base_files_are_valid_for_both(tmp_path, run_pinload):
    for name, data in base_files().items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        assert stfiles.reference_accepts(path) == (True, None), name
        assert run_pinload("inspect", path).returncode == 0, name


@pytest.mark.parametrize("base", ["reference", "hand", "minimal"])
def test_pinload_accepts_exactly_what_safetensors_accepts(tmp_path, run_pinload, base):
    rng = stfiles.seeded({"reference": 1, "hand": 2, "minimal": 3}[base])
    original = base_files()[base]
    path = tmp_path / "m.safetensors"
    disagreements, stricter, accepted, rejected = [], 0, 0, 0
    for label, data in mutations(base, original, rng):
        path.write_bytes(data)
        ref_ok, ref_error = stfiles.reference_accepts(path)
        run = run_pinload("inspect", "--json", path)
        assert run.returncode in (0, 1), f"{label}: {run}"  # never a signal (negative) or anything else
        ours_ok = run.returncode == 0
        if ours_ok:
            accepted += 1
        else:
            rejected += 1
            lines = run.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"pinload: error: {path}: "), f"{label}: {run}"
        if ours_ok == ref_ok:
            if ours_ok:  # both accept: same tensors, dtypes, shapes and metadata
                tensors, metadata = reference_view(path)
                out = json.loads(run.stdout)["files"][0]
                assert {t["name"]: (t["dtype"], t["shape"]) for t in out["tensors"]} == tensors, label
                assert out["metadata"] == metadata, label
            continue
        if ref_ok and any(s in run.stderr for s in STRICTER):
            stricter += 1
            continue
        disagreements.append(f"{label}: pinload {'accepts' if ours_ok else 'rejects: ' + run.stderr.strip()}; "
                             f"safetensors {'accepts' if ref_ok else 'rejects: ' + str(ref_error)}")
    assert not disagreements, "\n".join(disagreements[:20]) + f"\n({len(disagreements)} in all)"
    assert accepted > 0 and rejected > 0
    if base != "minimal":  # renaming a tensor over a zero-size one: a duplicate only pinload refuses
        assert stricter > 0


# Bounded so that the suite stays fast: a fixed seed, N generated files, a few mutations of each.
GENERATED_FILES = 40


def test_generated_files_verdicts_and_bytes_match_the_reference(tmp_path, run_pinload):
    """The generator half of the differential harness: random valid files of every dtype (hand-written
    and numpy-written, shuffled JSON order, odd names, metadata) and a few seeded mutations of each.
    pinload and the reference must agree on every verdict, and where both accept, `pinload load
    --digest` must give the bytes the reference reads (stfiles.expected_digest)."""
    rng = stfiles.seeded(13)
    path = tmp_path / "g.safetensors"
    checked_bytes, disagreements = 0, []
    for case in range(GENERATED_FILES):
        (stfiles.write_random_raw if case % 2 else stfiles.write_random_numpy)(path, rng, rng.randrange(1, 8))
        original = path.read_bytes()
        variants = [("generated", original)] + rng.sample(list(mutations(f"g{case}", original, rng)), 3)
        for label, data in variants:
            path.write_bytes(data)
            ref_ok, ref_error = stfiles.reference_accepts(path)
            run = run_pinload("load", "--digest", path)
            assert run.returncode in (0, 1), f"{case} {label}: {run}"
            ours_ok = run.returncode == 0
            if ours_ok != ref_ok:
                if ref_ok and any(s in run.stderr for s in STRICTER):
                    continue
                disagreements.append(f"{case} {label}: pinload {run.stderr.strip() or 'accepts'}; "
                                     f"safetensors {ref_error or 'accepts'}")
                continue
            if ours_ok:
                assert run.stdout.splitlines() == stfiles.expected_digest(path), f"{case} {label}"
                checked_bytes += 1
    assert not disagreements, "\n".join(disagreements[:20])
    assert checked_bytes >= GENERATED_FILES
