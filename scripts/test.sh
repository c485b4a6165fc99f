#!/usr/bin/env bash
# scripts/test.sh --quick: the layer check, set-up and build of build/, then the unit and Python
# suites (ctest -L 'unit|python', the vLLM plugin's left out): no vLLM set-up, wheel, qemu or
# sanitizer builds. What a change is checked with before the full run.
#
# scripts/test.sh: every test, what CI runs (.ci/run): check the layers of src/
# (scripts/check-layers.py, before anything is built), set up and build, set up vLLM's venv
# (scripts/setup-vllm.sh; PINLOAD_SKIP_VLLM=1 leaves it out), run the whole suite (unit, Python,
# install consumer), the conversion test cross-built for aarch64 under qemu
# (scripts/test-aarch64.sh), then the ASan+UBSan build with a short fuzz
# run, then the TSan build of the unit suites. The wheel is built as `pip wheel .` on a
# pseudo-terminal, repaired with auditwheel and smoke-tested in a fresh venv (scripts/test-wheel.sh:
# a full compile the first time, 7 minutes on 2 cores; build-wheel/ keeps the build and a rerun
# takes about 30 s). PINLOAD_TEST_WHEEL=0 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
case ${1:-} in
  "") ;;
  --quick) QUICK=1 ;;
  *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
esac
# The layer check needs only Python 3 and takes a second: first, or after the
# set-up where a fresh machine has no Python yet.
echo "== layers (scripts/check-layers.py)"
layers_checked=0
if command -v python3 >/dev/null; then python3 scripts/check-layers.py; layers_checked=1; fi
scripts/setup.sh
if [[ $layers_checked == 0 ]]; then python3 scripts/check-layers.py; fi
JOBS=${JOBS:-$(nproc)}

if [[ $QUICK == 1 ]]; then
  echo "== unit and Python tests (build/)"
  (cd build && ctest --output-on-failure -j "$JOBS" -L 'unit|python' -E '^python_vllm_tests$')
  echo "== quick tests passed (scripts/test.sh with no flag runs every test)"
  exit 0
fi

# The vLLM plugin's tests run in a venv of their own (vllm --no-deps over this torch). It never
# fails the set-up: the tests skip with the reason instead.
[[ ${PINLOAD_SKIP_VLLM:-0} == 1 ]] || scripts/setup-vllm.sh

echo "== tests (build/)"
(cd build && ctest --output-on-failure -j "$JOBS")

if [[ ${PINLOAD_TEST_WHEEL:-1} == 1 ]]; then
  echo "== the wheel, portable and in a fresh venv (build-wheel/)"
  scripts/test-wheel.sh
fi

echo "== aarch64 conversions under qemu (build-aarch64/)"
scripts/test-aarch64.sh

echo "== ASan + UBSan + fuzz (build-asan/, clang)"
if [[ ! -f build-asan/build.ninja ]]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DPINLOAD_SANITIZE=address,undefined -DPINLOAD_FUZZ=ON -DPINLOAD_BUILD_BENCH=OFF -DPINLOAD_WITH_PYTHON=OFF -DPINLOAD_WITH_TORCH=OFF -DPINLOAD_WERROR=ON >/dev/null
fi
cmake --build build-asan
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j "$JOBS" -L 'unit|fuzz')

echo "== TSan (build-tsan/, clang)"
if [[ ! -f build-tsan/build.ninja ]]; then
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DPINLOAD_SANITIZE=thread -DPINLOAD_BUILD_BENCH=OFF -DPINLOAD_WITH_PYTHON=OFF -DPINLOAD_WITH_TORCH=OFF -DPINLOAD_WERROR=ON >/dev/null
fi
cmake --build build-tsan
(cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j "$JOBS" -L unit)
echo "== all tests passed"
