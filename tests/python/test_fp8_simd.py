"""The host conversions on every SIMD target, forced with PINLOAD_SIMD in a
process of its own (it is read at the first conversion), against numpy and
ml_dtypes: all 256 codes of both FP8 formats under several scales (short runs
take the arithmetic kernel, long ones the table), all 65536 bf16 and fp16
patterns, and float32 values of every magnitude. NaN compares as NaN (its
payload is free, Note [Rounding as torch]); every other value bit for bit.
Targets this CPU cannot run are skipped (the conversion refuses them)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TARGETS = ["avx512vbmi", "avx512", "avx2", "sse4", "ssse3", "sve2", "sve", "neon", "scalar"]

CHECK = r"""
import ml_dtypes
import numpy as np
from pinload import _core

def same(got, want, what):
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert (gn == wn).all(), what + ": NaN at different places"
    g, w = got[~gn], want[~wn]
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    bad = np.nonzero(g.view(bits) != w.view(bits))[0]
    assert bad.size == 0, f"{what}: {bad.size} differ, first {g[bad[0]]!r} for {w[bad[0]]!r}"

OUT = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
for name, fmt in FP8.items():
    for n in (300, 256 * 5):
        codes = (np.arange(n) * 37 % 256).astype(np.uint8)
        for scale in (1.0, 0.0123, 1 / 448, 2.0 ** -20, 300.0, -2.5):
            for out, dt in OUT.items():
                got = np.frombuffer(_core.convert_bytes(codes.tobytes(), name, out, scale=scale), dtype=dt)
                want = (codes.view(fmt).astype(np.float32) * np.float32(scale)).astype(dt)
                same(got, want, f"{name} -> {out}, {n} codes, scale {scale}")

every16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
for name, dt in (("BF16", ml_dtypes.bfloat16), ("F16", np.float16)):
    x = every16.view(dt)
    for out, odt in OUT.items():
        got = np.frombuffer(_core.convert_bytes(x.tobytes(), name, out), dtype=odt)
        same(got, x.astype(np.float32).astype(odt), f"every {name} -> {out}")

rng = np.random.default_rng(3)
f32 = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                      (rng.standard_normal(200_000) * 10.0 ** rng.integers(-9, 9, 200_000)).astype(np.float32)])
for out, odt in (("BF16", ml_dtypes.bfloat16), ("F16", np.float16)):
    got = np.frombuffer(_core.convert_bytes(f32.tobytes(), "F32", out), dtype=odt)
    same(got, f32.astype(odt), f"F32 -> {out}")
print("ok")
"""


@pytest.mark.parametrize("target", TARGETS)
def test_host_conversions_match_numpy_on_every_simd_target(target):
    env = dict(os.environ, PINLOAD_SIMD=target)
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    if "is not one this build runs on this CPU" in r.stderr:
        pytest.skip(f"{target}: not runnable here")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
