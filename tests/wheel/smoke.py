"""Smoke test of an installed pinload wheel (scripts/test-wheel.sh runs it in a fresh venv).

Checks that pinload comes from the venv, that its binaries find every library that is not in
the manylinux set inside the wheel (pinload.libs/, vendored by auditwheel repair), that no binary
names a CUDA library and the wheel carries none (CUDA is opened at run time: Note [CUDA at run time]
in docs/gpu.md), and that a load through the Python API and through the `pinload` console script
equals what safetensors reads from the same file. PINLOAD_WHEEL_EXPECT_CUDA=1: the wheel must
have been built with CUDA; on a machine with a GPU it also loads to cuda:0.
"""

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pinload
import pinload.numpy
import safetensors.numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "consumers"))
import check  # noqa: E402  (the consumer tests' checkpoint)

# Libraries every manylinux platform provides (the glibc, the compiler runtime and libz: the
# policy auditwheel applies, PEP 599); every other library a pinload binary loads must come from
# the wheel.
SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libutil|libresolv|libnsl|libcrypt|libz)\.")


def fail(msg):
    sys.exit(f"wheel smoke test: FAIL: {msg}")


package = Path(pinload.__file__).resolve().parent
if not package.is_relative_to(Path(sys.prefix).resolve()):
    fail(f"pinload was imported from {package}, not from the venv {sys.prefix}")
libs_dir = package.parent / "pinload.libs"
binaries = sorted(package.glob("_core*.so")) + [package / "bin" / "pinload"]
for binary in binaries:
    if not binary.is_file():
        fail(f"{binary} is missing from the wheel")
    out = subprocess.run(["ldd", str(binary)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0]
        where = line.split("=>")[1].split("(")[0].strip() if "=>" in line else ""
        if "cudart" in name or "libcuda." in name:
            fail(f"{binary.name} links {name}: CUDA must be opened at run time, not linked")
        if SYSTEM.match(name) or name.startswith("/"):
            continue
        if where == "not found" or not Path(where).resolve().is_relative_to(libs_dir.resolve()):
            fail(f"{binary.name} loads {name} from {where!r}, not from the wheel's {libs_dir}")
    print(f"{binary.name}: every library outside the manylinux set comes from {libs_dir.name}/")
vendored_cuda = [p.name for p in libs_dir.glob("*") if "cudart" in p.name or p.name.startswith("libcuda.")]
if vendored_cuda:
    fail(f"the wheel carries CUDA libraries {vendored_cuda}: CUDA must come from the machine it runs on")

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model.safetensors")
    check.write(path)
    ref = safetensors.numpy.load_file(path)

    got = pinload.numpy.load_file(path)
    if sorted(got) != sorted(ref):
        fail(f"pinload.numpy.load_file names {sorted(got)} != safetensors' {sorted(ref)}")
    for name, want in ref.items():
        if got[name].dtype != want.dtype or got[name].shape != want.shape or got[name].tobytes() != want.tobytes():
            fail(f"{name}: pinload.numpy.load_file differs from safetensors.numpy.load_file")
    print(f"pinload.numpy.load_file: {len(ref)} tensors equal to safetensors'")

    try:
        import torch
        import safetensors.torch
    except ImportError:
        torch = None
    if torch is not None:
        import pinload.torch
        want_t = safetensors.torch.load_file(path)
        got_t = pinload.torch.load_file(path)
        for name, want in want_t.items():
            if got_t[name].dtype != want.dtype or not torch.equal(got_t[name], want):
                fail(f"{name}: pinload.torch.load_file differs from safetensors.torch.load_file")
        print(f"pinload.torch.load_file: {len(want_t)} tensors equal to safetensors'")

    # The console script runs the C++ program shipped in the wheel.
    cli = Path(sys.prefix) / "bin" / "pinload"
    out = subprocess.run([str(cli), "load", "-q", "--digest", path], check=True, capture_output=True, text=True).stdout
    digests = {line.split("\t")[0]: line.split("\t")[3] for line in out.splitlines()}
    for name, want in ref.items():
        if digests.get(name) != hashlib.sha256(np.ascontiguousarray(want).tobytes()).hexdigest():
            fail(f"{name}: `pinload load --digest` differs from the SHA-256 of safetensors' bytes")
    print(f"pinload load --digest: {len(ref)} digests equal to safetensors' bytes")

    available, why = pinload.cuda_available()
    print(f"CUDA: built with it: {pinload._core.built_with_cuda()}, available: {available} ({why or 'yes'})")
    if os.environ.get("PINLOAD_WHEEL_EXPECT_CUDA") == "1" and not pinload._core.built_with_cuda():
        fail("the wheel was built without CUDA")
    if available and torch is not None:
        got_c = pinload.torch.load_file(path, device="cuda:0")
        for name, want in want_t.items():
            if got_c[name].device.type != "cuda" or not torch.equal(got_c[name].cpu(), want):
                fail(f"{name}: the load to cuda:0 differs from safetensors'")
        print(f"pinload.torch.load_file(device='cuda:0'): {len(want_t)} tensors equal to safetensors'")
print("wheel smoke test: ok")
