"""The optional write-through cache (Note [Remote cache]): the first load
writes the object as its ranges arrive, the second reads local disk (only the
header comes from the server), a changed object misses, a failed load leaves
no entry, and the byte budget evicts the least recently used."""

import os
import shutil
import signal
import subprocess
import time

import pytest

import stfiles
from fault_proxy import FaultProxy
from test_remote_load import FAST_RETRIES, big_file, digests, one_error, run


def entries(folder):
    """The cache's files, without the digests beside each entry."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".sha256"))


def test_second_load_reads_the_cache(pinload_bin, nginx, served_root, tmp_path):
    path = big_file(tmp_path / "c.safetensors", 1, seed=31)
    served_copy(path, served_root, "cached.safetensors")
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
    assert list(cache.iterdir()) == []  # neither an entry nor a .part file


def served_copy(src, served_root, name):
    """`src` under nginx's root, dated a minute back (its validator is settled: Note [Remote
    consistency]), so that no load waits for it."""
    shutil.copy(src, served_root / name)
    old = time.time() - 60
    os.utime(served_root / name, (old, old))


def test_an_entry_changed_on_local_disk_is_dropped_and_read_again(pinload_bin, nginx, served_root, tmp_path):
    path = big_file(tmp_path / "t.safetensors", 1, seed=34)
    served_copy(path, served_root, "tampered.safetensors")
    cache = tmp_path / "cache"
    url = nginx.url + "/tampered.safetensors"
    env = {"PINLOAD_CACHE_DIR": str(cache), "PINLOAD_LOG_LEVEL": "debug"}
    assert digests(run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)) == \
        stfiles.expected_digest(path)
    [entry] = [p for p in cache.iterdir() if p.name.endswith(".safetensors")]
    # 4 KiB overwritten in the middle of a tensor, the size unchanged.
    with open(entry, "r+b") as f:
        f.seek(os.path.getsize(entry) // 2)
        f.write(os.urandom(4096))
    again = run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)
    assert digests(again) == stfiles.expected_digest(path)
    assert "from the local cache" not in again.stderr
    assert "differ from the SHA-256 recorded" in again.stderr and "dropping it" in again.stderr, again.stderr
    assert entry.read_bytes() == path.read_bytes()  # written again from the server's bytes
    third = run(pinload_bin, "load", "--digest", "--block-size", "256K", url, env=env)
    assert digests(third) == stfiles.expected_digest(path) and "from the local cache" in third.stderr
    assert sorted(p.name for p in cache.iterdir()) == [entry.name, entry.name + ".sha256"]


def parts(folder):
    return sorted(p.name for p in folder.iterdir() if ".part-" in p.name)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["kill9", "int", "term"])
def test_part_files_of_a_killed_load_are_removed_later(pinload_bin, nginx, served_root, tmp_path, sig):
    """A load killed by a signal leaves its .part file (full size); the next load through the cache
    removes it: its writer's flock died with it (Note [Remote cache])."""
    path = big_file(tmp_path / "k.safetensors", 1, seed=35)
    served_copy(path, served_root, "killed.safetensors")
    other = big_file(tmp_path / "k2.safetensors", 1, seed=36)
    served_copy(other, served_root, "after-kill.safetensors")
    cache = tmp_path / "cache"
    # Every data range after the first two stalls: the load sits mid-object.
    proxy = FaultProxy(nginx.port, lambda r: {"stall_after": 0, "for": 30}
                       if r["range"] and r["range"][0] > 0 and r["n"] > 3 else None)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           "PINLOAD_CACHE_DIR": str(cache), "PINLOAD_CACHE_BYTES": str(3 * os.path.getsize(path))}
    try:
        proc = subprocess.Popen([pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "1",
                                 proxy.url + "/killed.safetensors"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not (cache.is_dir() and parts(cache)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # into the stalled ranges
        proc.send_signal(sig)
        proc.communicate(timeout=20)
        assert proc.returncode == -sig
    finally:
        proxy.stop()
    [left] = parts(cache)
    assert os.path.getsize(cache / left) == os.path.getsize(path)
    # A later load (of another object) sweeps it.
    later = run(pinload_bin, "load", "--digest", nginx.url + "/after-kill.safetensors",
                env={**env, "PINLOAD_LOG_LEVEL": "info"})
    assert digests(later) == stfiles.expected_digest(other)
    assert parts(cache) == [], entries(cache)
    assert "left by a writer that died" in later.stderr, later.stderr


def test_live_part_files_count_in_the_budget(pinload_bin, nginx, served_root, tmp_path):
    """The budget holds entries and the .part files of loads in progress: with one load stalled
    mid-object (its .part file holds 512 KiB), a new entry evicts the older one, which the two
    entries alone would not."""
    files = {}
    for seed, name in ((37, "old-entry"), (38, "in-progress"), (39, "new-entry")):
        files[name] = big_file(tmp_path / f"{name}.safetensors", 1, seed=seed)
        served_copy(files[name], served_root, f"{name}.safetensors")
    size = os.path.getsize(files["old-entry"])
    cache = tmp_path / "cache"
    env = {"PINLOAD_CACHE_DIR": str(cache), "PINLOAD_CACHE_BYTES": str(2 * size + 200_000)}
    assert digests(run(pinload_bin, "load", "--digest", nginx.url + "/old-entry.safetensors", env=env))
    [old_entry] = entries(cache)
    # Two data ranges of 256 KiB arrive, then every range stalls.
    proxy = FaultProxy(nginx.port, lambda r: {"stall_after": 0, "for": 30}
                       if r["range"] and r["range"][0] > 0 and r["n"] > 3 else None)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **env}
    proc = subprocess.Popen([pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "1",
                             proxy.url + "/in-progress.safetensors"], env=full, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                os.stat(cache / p).st_blocks * 512 >= 512 << 10 for p in parts(cache)):
            time.sleep(0.05)
        assert digests(run(pinload_bin, "load", "--digest", nginx.url + "/new-entry.safetensors", env=env))
        assert old_entry not in entries(cache), entries(cache)
        assert len(parts(cache)) == 1  # the live one is not swept
    finally:
        proc.kill()
        proc.wait()
        proxy.stop()
