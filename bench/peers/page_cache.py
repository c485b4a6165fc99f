"""Page-cache control for the cold and warm runs: evict a set's files, read them once,
and measure how much of them is cached."""
from __future__ import annotations

import os


def drop_caches(files: list[str], level: int = 1) -> str:
    """sync, then `echo LEVEL > /proc/sys/vm/drop_caches` as root (1: the page cache; 3: also
    dentries and inodes); otherwise evict(files)."""
    os.sync()
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write(f"{level}\n")
            return f"drop_caches {level}"
        except OSError:
            pass
    evict(files)
    return "fadvise_dontneed"


def evict(files: list[str]) -> str:
    """Drop these files' pages from the page cache (and only these: a global
    drop_caches would also evict torch's libraries, so that every worker's imports
    read a gigabyte from disk first)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed (the set's files)"


def cached_bytes(files: list[str]) -> int | None:
    """Bytes of these files in the page cache (util-linux fincore), None without it."""
    import shutil
    import subprocess
    if not shutil.which("fincore"):
        return None
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                       capture_output=True, text=True)
    try:
        return sum(int(x) for x in r.stdout.split())
    except ValueError:
        return None


def read_all(files: list[str]):
    buf = bytearray(1 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
