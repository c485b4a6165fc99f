"""Faults of Note [Remote faults], injected for real: a proxy in front of nginx
and SeaweedFS that answers 503, resets connections, stalls, strips Range or
rewrites Content-Range; objects overwritten mid-load; a server killed."""

import os
import shutil
import subprocess
import threading
import time

import pytest

import stfiles
from conftest import BUCKET
from fault_proxy import FaultProxy
import servers
from test_remote_load import FAST_RETRIES, big_file, digests, one_error, run

BLOCK = 256 << 10


@pytest.fixture(scope="module")
def model(tmp_path_factory, served_root):
    """A 8 MiB checkpoint under nginx's root: (local path, URL path)."""
    path = big_file(tmp_path_factory.mktemp("faults") / "m.safetensors", 2, seed=11)
    shutil.copy(path, served_root / "faults.safetensors")
    return path, "/faults.safetensors"


def data_request(request, after=1):
    """Chunk reads: ranged GETs after the two header reads."""
    return request["range"] is not None and request["range"][0] > 0 and request["range"][1] - request["range"][0] > 4096


def load_via(pinload_bin, proxy, url_path, *extra, env=None):
    return run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "4", *extra,
               proxy.url + url_path, env={**FAST_RETRIES, **(env or {})})


def test_503_and_429_are_retried(pinload_bin, nginx, model):
    path, url_path = model
    failed = []

    def fault(r):
        if data_request(r) and len(failed) < 6:
            failed.append(r["range"])
            return {"status": 503 if len(failed) % 2 else 429}

    proxy = FaultProxy(nginx.port, fault)
    try:
        assert digests(load_via(pinload_bin, proxy, url_path)) == stfiles.expected_digest(path)
    finally:
        proxy.stop()
    assert len(failed) == 6
    # Each failed range was asked again, whole.
    asked = [r["range"] for r in proxy.log]
    for rng in failed:
        assert asked.count(rng) >= 2


def test_reset_mid_body_asks_only_for_the_missing_part(pinload_bin, nginx, model):
    path, url_path = model
    cut = []

    def fault(r):
        if data_request(r) and r["range"][1] - r["range"][0] + 1 == BLOCK and len(cut) < 6:
            cut.append(r["range"])
            return {"drop_after": 100_000}

    proxy = FaultProxy(nginx.port, fault)
    try:
        assert digests(load_via(pinload_bin, proxy, url_path)) == stfiles.expected_digest(path)
    finally:
        proxy.stop()
    assert len(cut) == 6
    asked = [r["range"] for r in proxy.log if r["range"]]
    for first, last in cut:
        # The tail only: what arrived before the reset (up to 100,000 bytes;
        # a reset may discard some the kernel had received) is kept.
        assert any(a == last and first < f <= first + 100_000 for f, a in asked), (first, last, asked)
    requested = sum(b - a + 1 for a, b in asked)
    assert requested < os.path.getsize(path) + 6 * BLOCK  # nothing else read twice


def test_stall_times_out_and_retries(pinload_bin, nginx, model):
    path, url_path = model
    stalled = []

    def fault(r):
        if data_request(r) and not stalled:
            stalled.append(r["range"])
            return {"stall_after": 10_000, "for": 40}

    proxy = FaultProxy(nginx.port, fault)
    try:
        start = time.monotonic()
        proc = load_via(pinload_bin, proxy, url_path, env={"PINLOAD_REMOTE_LOW_SPEED_TIME": "1"})
        assert digests(proc) == stfiles.expected_digest(path)
        # libcurl averages the rate over the last 5 s: the stall is seen
        # about 5 s + LOW_SPEED_TIME after it starts, long before it ends.
        assert time.monotonic() - start < 25
    finally:
        proxy.stop()
    assert stalled


def test_server_ignoring_range_is_detected(pinload_bin, nginx, model):
    _, url_path = model
    proxy = FaultProxy(nginx.port, lambda r: {"strip_range": True})
    try:
        line = one_error(load_via(pinload_bin, proxy, url_path), proxy.url + url_path)
    finally:
        proxy.stop()
    assert "ignores Range" in line, line


def test_content_range_mismatch_is_an_error(pinload_bin, nginx, model):
    _, url_path = model
    proxy = FaultProxy(nginx.port, lambda r: {"content_range": "bytes 0-7/99"} if data_request(r) else None)
    try:
        line = one_error(load_via(pinload_bin, proxy, url_path), proxy.url + url_path)
    finally:
        proxy.stop()
    assert "Content-Range" in line and re.search(r"\[\d+, \d+\)|bytes \d+", line), line


def test_overwrite_mid_load_over_http(pinload_bin, nginx, served_root, tmp_path):
    src = big_file(tmp_path / "o.safetensors", 2, seed=12)
    target = served_root / "overwritten.safetensors"
    shutil.copy(src, target)
    other = big_file(tmp_path / "o2.safetensors", 2, seed=13)
    done = []

    def overwrite():
        shutil.copy(other, target)
        os.utime(target, (time.time() + 100, time.time() + 100))  # nginx's ETag is mtime-size

    def fault(r):
        if data_request(r) and not done:
            done.append(1)
            return {"before": overwrite}

    proxy = FaultProxy(nginx.port, fault)
    try:
        line = one_error(load_via(pinload_bin, proxy, "/overwritten.safetensors"), proxy.url)
    finally:
        proxy.stop()
    assert "changed" in line, line


def test_overwrite_mid_load_over_s3(pinload_bin, weed, tmp_path):
    src = big_file(tmp_path / "s.safetensors", 2, seed=14)
    other = big_file(tmp_path / "s2.safetensors", 2, seed=15)
    client = weed.client()
    client.upload_file(str(src), BUCKET, "overwrite/m.safetensors")
    done = []

    def fault(r):
        if data_request(r) and not done:
            done.append(1)
            return {"before": lambda: client.upload_file(str(other), BUCKET, "overwrite/m.safetensors")}

    proxy = FaultProxy(weed.port, fault)
    try:
        proc = run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "2",
                   f"s3://{BUCKET}/overwrite/m.safetensors",
                   env=weed.env(AWS_ENDPOINT_URL=proxy.url, **FAST_RETRIES))
        line = one_error(proc, f"s3://{BUCKET}/overwrite/m.safetensors")
    finally:
        proxy.stop()
    assert "changed" in line or "412" in line, line


def test_server_killed_mid_load(pinload_bin, tmp_path, model):
    path, _ = model
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(path, root / "m.safetensors")
    slow = servers.Nginx(str(root), limit_rate="1m")
    try:
        url = slow.url + "/m.safetensors"
        full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        full.update(FAST_RETRIES)
        proc = subprocess.Popen([pinload_bin, "load", "--digest", "--connections", "2", url], env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        slow.stop()
        out, err = proc.communicate(timeout=60)
    finally:
        slow.cleanup()
    assert proc.returncode == 1, (out, err)
    line = err.splitlines()[-1]
    assert line.startswith("pinload: error: " + url) and "attempts" in line, err
    assert re.search(r"\d+", line)


import re  # noqa: E402


def test_same_second_same_size_swap_over_http_is_never_mixed(pinload_bin, nginx, served_root, tmp_path):
    """nginx's ETag is "<hex mtime in seconds>-<hex size>": a file renamed over the object within
    the second it was written, of the same size, keeps ETag and Last-Modified (Note [Remote
    consistency]). The load gives one version whole (or a typed error), never a mix."""
    v1 = big_file(tmp_path / "v1.safetensors", 2, seed=41)
    v2 = big_file(tmp_path / "v2.safetensors", 2, seed=42)
    assert os.path.getsize(v1) == os.path.getsize(v2)
    target, staged = served_root / "swapped.safetensors", served_root / "swapped.next"
    time.sleep(1.02 - time.time() % 1)  # the start of a second
    second = int(time.time())
    shutil.copy(v1, target)
    shutil.copy(v2, staged)
    for p in (target, staged):
        os.utime(p, (second, second))
    # The swap, in that same second, while the load reads its chunks one at a time (each held).
    swap = threading.Timer(second + 0.6 - time.time(), os.rename, (staged, target))
    proxy = FaultProxy(nginx.port, lambda r: {"before": lambda: time.sleep(0.15)} if data_request(r) else None)
    try:
        swap.start()
        proc = run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "1",
                   proxy.url + "/swapped.safetensors", env=FAST_RETRIES)
        swap.join()
    finally:
        proxy.stop()
    if proc.returncode == 0:
        assert digests(proc) in (stfiles.expected_digest(v1), stfiles.expected_digest(v2)), "a mixed result"
    else:
        assert "changed" in one_error(proc, proxy.url)


def test_invalid_content_range_says_what_is_wrong(pinload_bin, nginx, model):
    _, url_path = model
    for bad, why in (("bytes 900-100/8389000", "last byte is before its first"),
                     ("bytes 0-10/5", "past the object's 5 bytes"),
                     ("octets 0-10/50", "unit is not 'bytes'")):
        proxy = FaultProxy(nginx.port, lambda r: {"content_range": bad} if data_request(r) else None)
        try:
            line = one_error(load_via(pinload_bin, proxy, url_path), proxy.url + url_path)
        finally:
            proxy.stop()
        assert f'invalid Content-Range "{bad}"' in line and why in line, line


def test_a_server_that_stalls_every_range_fails_in_bounded_time(pinload_bin, nginx, model):
    """Each range sends 1000 bytes, then stalls: progress must not restart the count of stalls
    (Note [Remote faults]); retries=2 gives up after 3 attempts of the range, in seconds."""
    _, url_path = model
    proxy = FaultProxy(nginx.port, lambda r: {"stall_after": 1000, "for": 30} if data_request(r) else None)
    try:
        start = time.monotonic()
        proc = run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "1",
                   proxy.url + url_path, env={"PINLOAD_REMOTE_RETRIES": "2", "PINLOAD_REMOTE_RETRY_BASE_MS": "10",
                                              "PINLOAD_REMOTE_LOW_SPEED_TIME": "1"})
        elapsed = time.monotonic() - start
        line = one_error(proc, proxy.url + url_path)
    finally:
        proxy.stop()
    assert "stalled" in line and "after 3 attempts" in line, line
    ends = [r["range"][1] for r in proxy.log if data_request(r)]
    assert max(ends.count(e) for e in ends) == 3, proxy.log
    assert elapsed < 15, elapsed


def test_last_modified_alone_is_checked_on_every_answer(pinload_bin, nginx, served_root, tmp_path):
    """A server that sends Last-Modified but no ETag: an object overwritten mid-load (same size,
    another second) is an error, not a mix; one that sends neither gets a warning."""
    v1 = big_file(tmp_path / "l1.safetensors", 2, seed=43)
    v2 = big_file(tmp_path / "l2.safetensors", 2, seed=44)
    target = served_root / "no-etag.safetensors"
    shutil.copy(v1, target)
    os.utime(target, (time.time() - 60, time.time() - 60))
    data_seen = []

    def overwrite():
        shutil.copy(v2, target)  # in place, mtime now

    def fault(r):
        if data_request(r):
            data_seen.append(1)
            if len(data_seen) == 2:
                return {"drop_headers": ["etag"], "before": overwrite}
        return {"drop_headers": ["etag"]}

    proxy = FaultProxy(nginx.port, fault)
    try:
        line = one_error(run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", "1",
                             proxy.url + "/no-etag.safetensors", env=FAST_RETRIES), proxy.url)
    finally:
        proxy.stop()
    assert "changed" in line and "Last-Modified" in line, line

    proxy = FaultProxy(nginx.port, lambda r: {"drop_headers": ["etag", "last-modified"]})
    try:
        proc = load_via(pinload_bin, proxy, "/no-etag.safetensors")
    finally:
        proxy.stop()
    assert digests(proc) == stfiles.expected_digest(v2)
    assert "neither ETag nor Last-Modified" in proc.stderr, proc.stderr
