#!/usr/bin/env bash
# The host conversions on aarch64 (issue 36): builds the conversion sources
# and dtype_convert_test with Debian's cross compiler and runs the test
# under qemu-user, where it forces every target the emulated CPU runs in
# turn (SVE2, SVE, NEON, scalar) on the emulated CPU `max` (512-bit SVE2),
# then Highway's SVE_256 and SVE2_128 targets on `max` with 256- and 128-bit
# vectors, and NEON on a NEON-only Cortex-A72; each run checks which target
# is the best.
# Installs what is missing (arm64 as a Debian multiarch architecture).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(uname -m) == aarch64 ]]; then
  echo "test-aarch64: on aarch64 already (build/'s dtype_convert_test runs natively)"
  exit 0
fi

PACKAGES=(g++-aarch64-linux-gnu qemu-user libhwy-dev:arm64 libgtest-dev:arm64)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "test-aarch64: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

OUT=${BUILD_DIR_AARCH64:-build-aarch64}
mkdir -p "$OUT"
CXX=(aarch64-linux-gnu-g++)
command -v ccache >/dev/null && CXX=(ccache aarch64-linux-gnu-g++)
LIB=/usr/lib/aarch64-linux-gnu
# Highway's and GoogleTest's headers are the same for every architecture:
# /usr/include after the cross compiler's own (never before its libc's).
FLAGS=(-std=c++20 -O2 -ffp-contract=off -Wall -Wextra -Werror -Iinclude -Isrc -idirafter /usr/include)
SOURCES=(src/format/dtype_convert.cc src/format/dtype_convert_simd.cc src/format/dtype.cc src/base/error.cc
         tests/unit/dtype_convert_test.cc)
objects=()
for s in "${SOURCES[@]}"; do
  o="$OUT/$(basename "$s").o"
  objects+=("$o")
  if [[ ! -f "$o" || "$s" -nt "$o" || -n "$(find src/format include -newer "$o" -name '*.h' -print -quit)" ]]; then
    "${CXX[@]}" "${FLAGS[@]}" -c "$s" -o "$o" &
  fi
done
wait
aarch64-linux-gnu-g++ -o "$OUT/dtype_convert_test" "${objects[@]}" "$LIB/libgtest_main.a" "$LIB/libgtest.a" \
  -L"$LIB" -lhwy -pthread -Wl,-rpath,"$LIB" -Wl,-rpath-link,"$LIB"

run() {  # CPU, targets (PINLOAD_TEST_TARGETS), the best target expected
  echo "== aarch64 dtype_convert_test under qemu-aarch64 -cpu ${1%%,*}${2:+ (targets: $2)}"
  local log
  log=$(PINLOAD_TEST_TARGETS=$2 qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu "$1" "$OUT/dtype_convert_test" --gtest_brief=1) ||
    { echo "$log"; return 1; }
  echo "$log" | grep -E 'runnable|PASSED'
  echo "$log" | grep -q "(best: $3)" || { echo "test-aarch64: the best target is not $3"; return 1; }
}
sve_length() {  # `max` with SVE vectors of $1 bits only
  local cpu="max,sve$1=on" bits
  for bits in 128 256 384 512 640 768 896 1024 1152 1280 1408 1536 1664 1792 1920 2048; do
    ((bits > $1)) && cpu+=",sve$bits=off"
  done
  echo "$cpu"
}
# max: 512-bit SVE2; every target. Then the targets of 256-bit SVE
# (Graviton 3) and 128-bit SVE2 (Grace) only, and a NEON-only CPU.
run max "" sve2
run "$(sve_length 256)" sve256 sve256
run "$(sve_length 128)" sve2_128 sve2_128
run cortex-a72 neon neon
echo "== aarch64: passed"
