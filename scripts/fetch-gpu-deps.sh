#!/usr/bin/env bash
# Fetches, on a Debian machine with a package mirror (the dev machine), the
# build dependencies that a bare GPU machine lacks, and unpacks them into
# .deps/ (git-ignored: add /.deps/ to .gitignore) so that they travel with the
# working tree. scripts/gpu-check.sh puts $PWD/.deps/usr on CMAKE_PREFIX_PATH
# and LD_LIBRARY_PATH when it exists.
#
# Usage: scripts/fetch-gpu-deps.sh [--force]
# Idempotent: a package already listed in .deps/MANIFEST is not fetched again
# (--force starts over). Documentation and man pages are dropped, and so are
# the .deb files once unpacked, to keep the carried tree small.
set -euo pipefail
cd "$(dirname "$0")/.."

DEPS=.deps
PACKAGES=(
  nlohmann-json3-dev              # nlohmann_json (header-only, CMake config)
  libspdlog-dev libspdlog1.10     # spdlog (compiled, external fmt)
  libfmt-dev libfmt9              # fmt, spdlog's dependency
  libgtest-dev libgmock-dev       # GTest (GTestTargets lists gmock's files too)
  libbenchmark-dev libbenchmark1debian  # Google Benchmark (bench/)
  libssl-dev libssl3              # OpenSSL::Crypto (the CLI's checksums)
  libhwy-dev libhwy1              # Highway: the host conversions' SIMD kernels
  libcli11-dev                    # CLI11 (header-only): the command line's parser
  libcurl4-openssl-dev libcurl4   # libcurl: remote sources
  # libcurl4's run-time closure, less libc and what every image has (the GPU image is
  # another distribution; only pinload's own binaries see these, through LD_LIBRARY_PATH)
  libbrotli1 libgssapi-krb5-2 libidn2-0 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0
  libldap-2.5-0 libnghttp2-14 libpsl5 librtmp1 libsasl2-2 libsasl2-modules-db libssh2-1
  libunistring2 libgnutls30 libhogweed6 libnettle8 libp11-kit0 libtasn1-6 libffi8 libgmp10
  libcom-err2 libdb5.3
)

if [[ ${1:-} == --force ]]; then
  rm -rf "$DEPS"
fi
mkdir -p "$DEPS"
touch "$DEPS/MANIFEST"

missing=()
for p in "${PACKAGES[@]}"; do
  grep -q "^$p " "$DEPS/MANIFEST" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "fetch-gpu-deps: all ${#PACKAGES[@]} packages already in $DEPS/ (MANIFEST)"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetch-gpu-deps: downloading ${missing[*]}"
if ! (cd "$work" && apt-get download "${missing[@]}" >/dev/null 2>"$work/err"); then
  # Usually only stale package lists; refresh once and retry.
  echo "fetch-gpu-deps: apt-get download failed ($(tail -1 "$work/err")); running apt-get update"
  apt-get update -qq
  (cd "$work" && apt-get download "${missing[@]}" >/dev/null)
fi

for deb in "$work"/*.deb; do
  name=$(dpkg-deb -f "$deb" Package)
  version=$(dpkg-deb -f "$deb" Version)
  dpkg -x "$deb" "$DEPS"
  echo "$name $version" >>"$DEPS/MANIFEST"
done
rm -rf "$DEPS/usr/share/doc" "$DEPS/usr/share/man" "$DEPS/usr/share/lintian"
rm -f "$DEPS"/usr/lib/x86_64-linux-gnu/lib{crypto,ssl}.a  # the shared ones serve; 10 MB less
sort -u -o "$DEPS/MANIFEST" "$DEPS/MANIFEST"
echo "fetch-gpu-deps: $DEPS/ holds $(wc -l <"$DEPS/MANIFEST") packages, $(du -sh "$DEPS" | cut -f1)"
