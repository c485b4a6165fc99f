#!/usr/bin/env bash
# pinload-bench on a fast "disk": ext4 on a loop device (direct I/O on) backed by a
# file in tmpfs. It shows what the reader does where storage is several GB/s, on a
# machine whose own disk is slower; it says nothing about a real drive's latency.
#
#   bench/fast_disk.sh FILE [pinload-bench options]     (as root; needs RAM for FILE twice)
set -euo pipefail
file=$1
shift
bin=${PINLOAD_BENCH:-$(dirname "$0")/../build-bench/bench/pinload-bench}
work=$(mktemp -d /dev/shm/pinload-fast-disk.XXXXXX)
mnt=$(mktemp -d)
loop=""
cleanup() {
  mountpoint -q "$mnt" && umount "$mnt"
  [[ -n "$loop" ]] && losetup -d "$loop"
  rm -rf "$work"
  rmdir "$mnt"
}
trap cleanup EXIT
size=$(stat -c %s "$file")
truncate -s $((size + size / 8 + (64 << 20))) "$work/disk.img"
mkfs.ext4 -q -F "$work/disk.img"
loop=$(losetup --direct-io=on -f --show "$work/disk.img")
mount "$loop" "$mnt"
cp "$file" "$mnt/"
sync
"$bin" --phases fio,cold "$@" "$mnt/$(basename "$file")"
