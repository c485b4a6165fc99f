#!/usr/bin/env python3
"""Where O_DIRECT reads land matters on a VM: one file read with 2 MiB direct preads, one thread,
into one reused 2 MiB buffer (what fio measures: its buffers are iodepth x bs) and into distinct
memory the size of the file (what a loader that keeps the model in memory must do). Both buffers
are THP-backed and faulted in before the timed read; the page cache is dropped before each run.

    bench/dest_memory.py FILE       (as root: it writes /proc/sys/vm/drop_caches)

On a virtio disk the host copies every read into guest memory, so the destination's footprint
shows up in the bandwidth; on bare metal with a DMA-capable drive it should not.
"""
import mmap, os, sys, time
path = sys.argv[1]
size = os.path.getsize(path)
B = 2 << 20
def drop():
    os.system("sync; echo 1 > /proc/sys/vm/drop_caches")
def run(distinct):
    n = (size + B - 1) // B * B
    buf = mmap.mmap(-1, n if distinct else B, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    # fault everything in first, as a re-load into a kept pool has it
    for i in range(0, len(buf), 4096): buf[i] = 1
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    drop()
    t = time.perf_counter(); off = 0
    while off < size:
        with (mv[off:off + B] if distinct else mv[:B]) as dst:
            got = os.preadv(fd, [dst], off)
        if got <= 0: break
        off += got
    dt = time.perf_counter() - t
    os.close(fd); mv.release(); buf.close()
    return size / dt / 1e9
for r in range(2):
    for distinct in (False, True):
        print("distinct" if distinct else "reused  ", round(run(distinct), 2), "GB/s", flush=True)
