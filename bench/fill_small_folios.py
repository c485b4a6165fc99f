#!/usr/bin/env python3
"""Reads files into the page cache as 4 KiB pages: readahead off (POSIX_FADV_RANDOM) and
64 KiB preads, so the kernel allocates no large folios. With the page cache dropped first,
this gives pinload-bench's cached-read phase the page cache of a fragmented machine
(docs/tuning.md, "Copies from the page cache"). FileHugePages in /proc/meminfo shows the result.

    sync; echo 3 > /proc/sys/vm/drop_caches; bench/fill_small_folios.py FILE...
"""
import os
import sys

for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        offset, size = 0, os.fstat(fd).st_size
        while offset < size:
            n = len(os.pread(fd, 1 << 16, offset))
            if n == 0:
                break
            offset += n
    finally:
        os.close(fd)
