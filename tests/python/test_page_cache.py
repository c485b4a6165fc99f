"""Note [Keeping the page cache]: a fresh process's cold load leaves its files in the page cache
where the rule says so (a worker restarted after it finds them there), and reads them with O_DIRECT
where told to bypass it; page_cache= and PINLOAD_PAGE_CACHE override the rule both ways.

The page cache is read with mincore(2) on a mapping of the file, after the loading process exits."""

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap

import pytest

import pinload

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_fraction(path) -> float:
    """The fraction of the file's pages in the page cache (mincore of a fresh mapping)."""
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        p = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert p is not None and p != ctypes.c_void_p(-1).value, ctypes.get_errno()
    try:
        assert _libc.mincore(p, size, vec) == 0, ctypes.get_errno()
    finally:
        _libc.munmap(p, size)
    return sum(b & 1 for b in vec) / pages


def evict(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_fraction(path) < 0.05


@pytest.fixture
def cold_file(tmp_path):
    path = tmp_path / "cold.safetensors"
    header = b'{"w":{"dtype":"U8","shape":[16777216],"data_offsets":[0,16777216]}}'
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.write(os.urandom(16 << 20))
    if not evict(path):
        pytest.skip("the page cache keeps the file (tmpfs?): no cold load here")
    return path


def load_fresh(path, env_value=None, **kwargs) -> dict:
    """Loads `path` in a fresh interpreter (a new worker) and returns its progress counters."""
    env = dict(os.environ)
    env.pop("PINLOAD_PAGE_CACHE", None)
    if env_value is not None:
        env["PINLOAD_PAGE_CACHE"] = env_value
    code = textwrap.dedent("""
        import sys, hashlib, pinload._core as core
        h = core.load_async([sys.argv[1].encode()], "cpu", **eval(sys.argv[2]))
        sd = h.result()
        p = h.progress()
        print(p["files_direct"], p["files_buffered"], p["files_zero_copy"])
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(path), repr(kwargs)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    direct, buffered, zero_copy = map(int, proc.stdout.split())
    return {"direct": direct, "buffered": buffered, "zero_copy": zero_copy}


def test_default_keeps_a_cold_file_that_fits(cold_file):
    assert load_fresh(cold_file) == {"direct": 0, "buffered": 0, "zero_copy": 1}
    assert cached_fraction(cold_file) > 0.99


def test_bypass_reads_direct_and_leaves_the_page_cache_alone(cold_file):
    assert load_fresh(cold_file, page_cache="bypass")["direct"] == 1
    assert cached_fraction(cold_file) < 0.05


def test_environment_variable_overrides_auto_both_ways(cold_file):
    assert load_fresh(cold_file, env_value="bypass")["direct"] == 1
    assert cached_fraction(cold_file) < 0.05
    # keep, on a load that reads into its pool (where auto bypasses): buffered
    assert load_fresh(cold_file, env_value="keep", zero_copy="off")["buffered"] == 1
    assert cached_fraction(cold_file) > 0.99


def test_option_wins_over_the_environment(cold_file):
    assert load_fresh(cold_file, env_value="keep", page_cache="bypass")["direct"] == 1
    assert cached_fraction(cold_file) < 0.05


def test_page_cache_option_is_checked():
    assert pinload.LoadOptions(page_cache="keep").page_cache == "keep"
    assert pinload.LoadOptions().page_cache == "auto"
    with pytest.raises(pinload.InvalidArgumentError, match="page_cache must be 'auto', 'keep' or 'bypass', not 'on'"):
        pinload.LoadOptions(page_cache="on")
    with pytest.raises(TypeError, match="page_cache"):
        pinload.LoadOptions(page_cache=True)
    with pytest.raises(pinload.InvalidArgumentError, match="contradicts"):
        pinload.LoadOptions(page_cache="bypass", zero_copy="on")
