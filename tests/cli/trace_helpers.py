"""Helpers for the page-cache trace tests (test_trace.py), sharing no code with pinload.

An independent reader and writer of pinload's I/O template format (its byte
layout is documented in include/pinload/io_template.h), page arithmetic, a
cgroup (v2 memory.max or v1 memory.limit_in_bytes) for memory-limited runs,
and the consumer scripts run in subprocesses: unmodified safetensors,
transformers and numpy code.
"""

import os
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

PAGE = 4096
MAGIC = b"PLTMPL\0\1"


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def read_template(path):
    """{"files": [(path, size, mtime_ns, inode, dev)], "dests": {name: [(file, off, len)]},
    "readers": [(pid, comm, exe)], "read_by": {name: [reader index per read]}, "version": 1 or 2}.
    Version 2 (a traced template) names the reader of each read; version 1 names none."""
    b = Path(path).read_bytes()
    assert b[:8] == MAGIC
    version, payload = struct.unpack_from("<IQ", b, 8)
    assert version in (1, 2) and payload == len(b) - 28
    assert struct.unpack_from("<Q", b, len(b) - 8)[0] == fnv1a(b[:-8])
    at = 20

    def u(fmt):
        nonlocal at
        v = struct.unpack_from("<" + fmt, b, at)
        at += struct.calcsize(fmt)
        return v[0]

    def s():
        nonlocal at
        n = u("I")
        v = b[at:at + n].decode()
        at += n
        return v

    files = []
    for _ in range(u("I")):
        p, _prefix = s(), s()
        files.append((p, u("Q"), u("q"), u("Q"), u("Q")))
    readers = []
    if version == 2:
        for _ in range(u("I")):
            readers.append((u("I"), s(), s()))
        assert readers, "a version-2 template names at least one reader"
    dests, read_by = {}, {}
    for _ in range(u("I")):
        name = s()
        dests[name], read_by[name] = [], []
        for _ in range(u("Q")):
            dests[name].append((u("I"), u("Q"), u("Q")))
            read_by[name].append(u("I") if version == 2 else None)
    assert at == len(b) - 8
    return {"files": files, "dests": dests, "readers": readers, "read_by": read_by, "version": version}


def pinload_device(st):
    """The device number as pinload's Env records it (statx: major << 32 | minor)."""
    return (os.major(st.st_dev) << 32) | os.minor(st.st_dev)


def write_template(path, files, dests):
    """files: [path]; dests: {name: [(file, off, len)]}; identities from os.stat."""
    body = struct.pack("<I", len(files))
    for p in files:
        st = os.stat(p)
        pb = p.encode()
        body += struct.pack("<I", len(pb)) + pb + struct.pack("<I", 0)
        body += struct.pack("<QqQQ", st.st_size, st.st_mtime_ns, st.st_ino, pinload_device(st))
    body += struct.pack("<I", len(dests))
    for name, reads in dests.items():
        nb = name.encode()
        body += struct.pack("<I", len(nb)) + nb + struct.pack("<Q", len(reads))
        for f, off, n in reads:
            body += struct.pack("<IQQ", f, off, n)
    head = MAGIC + struct.pack("<IQ", 1, len(body)) + body
    Path(path).write_bytes(head + struct.pack("<Q", fnv1a(head)))


def pages_of(ranges, size):
    """The set of page numbers the byte ranges [(off, len)] touch, clipped to size."""
    out = set()
    for off, n in ranges:
        end = min(off + n, size)
        if n <= 0 or off >= end:
            continue
        out.update(range(off // PAGE, (end + PAGE - 1) // PAGE))
    return out


def template_pages(t, path, dest="page-cache"):
    """Pages of `path` in the template's reads of `dest`, and the bytes recorded for it."""
    idx = [i for i, f in enumerate(t["files"]) if f[0] == str(path)]
    seen = []
    for f, off, n in t["dests"].get(dest, []):
        if f in idx:
            seen.append((off, n))
    size = t["files"][idx[0]][1] if idx else 0
    pages = pages_of(seen, size)
    total = sum(n for _, n in seen)
    return pages, total


def drop_file_cache(*paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class MemoryCgroup:
    """A fresh memory cgroup (v2 memory.max, else v1 memory.limit_in_bytes), removed on close."""

    def __init__(self, limit):
        name = "pinload-test-" + uuid.uuid4().hex[:8]
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/memory")
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
            self.path = v2 / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").exists() and (self.path / "memory.swap.max").write_text("0")
        elif (v1 / "memory.limit_in_bytes").exists():
            self.path = v1 / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        else:
            raise OSError("no memory cgroup controller")

    def enter_cmd(self, cmd):
        """cmd, run after the shell moves itself into the cgroup."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]

    def close(self):
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cgroup_available():
    try:
        c = MemoryCgroup(1 << 30)
        c.close()
        return ""
    except OSError as e:
        return f"no writable memory cgroup: {e}"


# A consumer that reads every tensor with safetensors and drops it (as a
# framework moving weights to a device would), after `init` seconds of
# "framework init"; prints the SHA-256 of all tensor bytes and its own
# /proc/self/io read_bytes and its load time.
CONSUMER = r"""
import hashlib, os, subprocess, sys, time
time.sleep(float(sys.argv[3]))
from safetensors import safe_open
h = hashlib.sha256()
t0 = time.perf_counter()
if os.environ.get("EAGER_WARM"):  # the bench's EagerLoad: read everything at the first access
    subprocess.run([os.environ["EAGER_WARM"], "warm", sys.argv[1]], check=True, capture_output=True)
pages = os.environ.get("DIGEST") == "pages"  # the bench's: one byte per page (every page touched, little CPU)
with safe_open(sys.argv[1], framework=sys.argv[2], backend=sys.argv[4]) as f:
    for k in sorted(f.keys()):
        b = memoryview(f.get_tensor(k)).cast("B")
        h.update(k.encode()); h.update(bytes(b[::4096]) if pages else bytes(b))
load_s = time.perf_counter() - t0
io = dict(l.split(":") for l in open("/proc/self/io").read().split("\n") if l)
print(h.hexdigest(), int(io["read_bytes"]), f"{load_s:.4f}")
"""


def reference_digest(path):
    import hashlib
    from safetensors import safe_open
    h = hashlib.sha256()
    with safe_open(str(path), framework="numpy") as f:
        for k in sorted(f.keys()):
            h.update(k.encode()); h.update(bytes(memoryview(f.get_tensor(k)).cast("B")))
    return h.hexdigest()


def consumer_cmd(path, init=0.0, backend="pread", framework="numpy"):
    return [sys.executable, "-c", CONSUMER, str(path), framework, str(init), backend]
