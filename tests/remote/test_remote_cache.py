"""The optional write-through cache (Note [Remote cache]): the first load
writes the object as its ranges arrive, the second reads local disk (only the
header comes from the server), a changed object misses, a failed load leaves
no entry, and the byte budget evicts the least recently used."""

import os
import shutil

import stfiles
from fault_proxy import FaultProxy
from test_remote_load import FAST_RETRIES, big_file, digests, one_error, run


def entries(folder):
    return sorted(p.name for p in folder.iterdir())


def test_second_load_reads_the_cache(pinload_bin, nginx, served_root, tmp_path):
    path = big_file(tmp_path / "c.safetensors", 1, seed=31)
    shutil.copy(path, served_root / "cached.safetensors")
    cache = tmp_path / "cache"
    proxy = FaultProxy(nginx.port)
    try:
        url = proxy.url + "/cached.safetensors"
        env = {"PINLOAD_CACHE_DIR": str(cache), "PINLOAD_LOG_LEVEL": "debug"}
        first = run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)
        assert digests(first) == stfiles.expected_digest(path)
        names = entries(cache)
        assert len(names) == 1 and names[0].endswith(".safetensors"), names
        assert (cache / names[0]).read_bytes() == path.read_bytes()
        asked_first = len(proxy.log)
        second = run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)
        assert digests(second) == stfiles.expected_digest(path)
        assert "from the local cache" in second.stderr
        assert len(proxy.log) - asked_first == 2  # the header's two ranges only

        # The object changes on the server: a new ETag misses the cache.
        other = big_file(tmp_path / "c2.safetensors", 1, seed=32)
        shutil.copy(other, served_root / "cached.safetensors")
        os.utime(served_root / "cached.safetensors", (1e9, 1e9))
        third = run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)
        assert digests(third) == stfiles.expected_digest(other)
        assert "from the local cache" not in third.stderr
        assert len(entries(cache)) == 2

        # A byte budget below two entries keeps the most recent only.
        budget = {**env, "PINLOAD_CACHE_BYTES": str(os.path.getsize(path) + 1)}
        shutil.copy(path, served_root / "cached.safetensors")
        os.utime(served_root / "cached.safetensors", (2e9, 2e9))
        assert digests(run(pinload_bin, "load", "--digest", url, env=budget)) == stfiles.expected_digest(path)
        assert len(entries(cache)) == 1
    finally:
        proxy.stop()


def test_failed_load_leaves_no_entry(pinload_bin, nginx, served_root, tmp_path):
    path = big_file(tmp_path / "f.safetensors", 1, seed=33)
    shutil.copy(path, served_root / "failing.safetensors")
    cache = tmp_path / "cache"
    proxy = FaultProxy(nginx.port, lambda r: {"status": 404} if r["range"] and r["range"][0] > 600_000 else None)
    try:
        url = proxy.url + "/failing.safetensors"
        one_error(run(pinload_bin, "load", "--digest", "--block-size", "256K", url,
                      env={"PINLOAD_CACHE_DIR": str(cache), **FAST_RETRIES}), url)
    finally:
        proxy.stop()
    assert entries(cache) == []  # neither an entry nor a .part file
