#!/usr/bin/env bash
# Builds and runs a consumer project (tests/consumers/) against the `cmake --install` output of
# a pinload build, and checks what it loads against safetensors' own reader:
#
#   scripts/test-consumers.sh BUILD_DIR WORK_DIR cpu|torch
#
# cpu:   find_package(pinload) with the CUDA toolkit hidden (off PATH, CUDAToolkit_ROOT and
#        CUDA_PATH pointing nowhere, find_package(CUDAToolkit) disabled); the programs must not
#        need libcudart or libcuda (readelf -d, ldd).
# torch: find_package(pinload COMPONENTS torch) with torch's CMake prefix and no other flag
#        (docs/torch.md); also builds and runs examples/load_to_torch.cc.
# ctest runs both (install_consumer_cpu, install_consumer_torch where pinload has the torch adapter).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
(($# == 3)) || { echo "usage: $0 BUILD_DIR WORK_DIR cpu|torch" >&2; exit 2; }
build=$(cd "$1" && pwd)
work=$2
kind=$3
PYTHON=${PYTHON:-python3}

rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
cmake --install "$build" --prefix "$work/prefix" >/dev/null
"$PYTHON" "$root/tests/consumers/check.py" write "$work/model.safetensors"

# run_and_check EXE: runs it on the checkpoint and compares with safetensors.
run_and_check() {
  echo "== $1"
  "$work/build/$1" "$work/model.safetensors" "$work/$1.bin" >"$work/$1.txt"
  "$PYTHON" "$root/tests/consumers/check.py" compare "$work/model.safetensors" "$work/$1.txt" "$work/$1.bin"
}

case $kind in
  cpu)
    no_cuda=(env "PATH=$(tr ':' '\n' <<<"$PATH" | grep -vi cuda | paste -sd:)" CUDAToolkit_ROOT=/nonexistent
             CUDA_PATH=/nonexistent CUDA_HOME=/nonexistent CUDACXX=/nonexistent/nvcc)
    "${no_cuda[@]}" cmake -S "$root/tests/consumers/cpu" -B "$work/build" -G Ninja \
                          -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON
    "${no_cuda[@]}" cmake --build "$work/build"
    for exe in consumer_cpu consumer_cpu_core; do
      if readelf -d "$work/build/$exe" | grep NEEDED | grep -i cuda; then
        echo "FAIL: $exe links CUDA directly" >&2; exit 1
      fi
      if ldd "$work/build/$exe" | grep -i -E 'libcuda|libcudart'; then
        echo "FAIL: $exe loads CUDA libraries at start" >&2; exit 1
      fi
      run_and_check "$exe"
    done
    ;;
  torch)
    torch_prefix=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
    cmake -S "$root/tests/consumers/torch" -B "$work/build" -G Ninja \
          -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" -DEXAMPLES_DIR="$root/examples"
    cmake --build "$work/build"
    run_and_check consumer_torch
    echo "== torch_example"
    "$work/build/torch_example" "$work/model.safetensors"
    ;;
  *)
    echo "$0: unknown consumer '$kind' (cpu or torch)" >&2; exit 2
    ;;
esac
echo "consumer $kind ok"
