"""The Python package over remote sources: tensors equal the reference
reader's, device loads (sim, streaming), prefetch and ModelCache through the
same chunk executor, and no leaked sockets, threads or blocks after 200
failing loads."""

import os
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pinload = pytest.importorskip("pinload")
import pinload.torch as pt  # noqa: E402
from safetensors.torch import load_file as reference_load  # noqa: E402

from conftest import BUCKET  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from test_remote_load import big_file  # noqa: E402


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory, weed, served_root):
    path = big_file(tmp_path_factory.mktemp("py") / "py.safetensors", 1, seed=21)
    weed.client().upload_file(str(path), BUCKET, "py/model.safetensors")
    shutil.copy(path, served_root / "py.safetensors")
    return path


def assert_same(got, path):
    expected = reference_load(str(path))
    assert list(got) == list(expected)
    for name, t in expected.items():
        assert torch.equal(got[name].cpu(), t), name


def test_host_and_sim_device_loads_over_s3(remote_model, s3_env):
    url = f"s3://{BUCKET}/py/model.safetensors"
    assert_same(pt.load_file(url, block_size="256K"), remote_model)
    assert_same(pt.load_file(url, device="sim", block_size="256K"), remote_model)
    # Streaming: staging budget of two blocks, far below the model.
    assert_same(pt.load_file(url, device="sim", block_size="256K", staging_bytes="1M"), remote_model)


def test_prefetch_then_load_over_http(remote_model, nginx):
    url = f"{nginx.url}/py.safetensors"
    handle = pinload.prefetch([url], block_size="256K")
    assert_same(pt.load_file(url, block_size="256K", prefetch=handle), remote_model)


def test_model_cache_over_http(remote_model, nginx):
    url = f"{nginx.url}/py.safetensors"
    from pinload.cache import ModelCache

    cache = ModelCache("64M", block_size="256K")
    assert_same(cache.get(url), remote_model)
    assert_same(cache.get(url), remote_model)  # from the cache


def test_connections_keyword_sets_the_connections_in_flight(remote_model, nginx, monkeypatch):
    # Counted at a proxy (one connection per request): each request is held 50 ms so that
    # every connection the load opens is busy at once. The keyword wins over the environment.
    from urllib.parse import urlparse

    from fault_proxy import HeldRequests

    held = HeldRequests(0.05)
    proxy = FaultProxy(urlparse(nginx.url).port, held)
    monkeypatch.setenv("PINLOAD_CONNECTIONS", "7")
    try:
        url = f"{proxy.url}/py.safetensors"
        for n, load in ((3, lambda: pt.load_file(url, block_size="64K", connections=3)),
                        (1, lambda: dict(pt.iter_tensors([url], block_size="64K", connections=1))),
                        (5, lambda: pinload.ModelCache("64M", block_size="64K", connections=5).get(url)),
                        (7, lambda: pt.load_file(url, block_size="64K"))):
            held.max_active = 0
            assert_same(load(), remote_model)
            assert held.max_active == n, (n, held.max_active)
        held.max_active = 0
        handle = pinload.prefetch([url], block_size="64K", connections=2)
        handle.wait(None)
        assert held.max_active == 2
        assert_same(pt.load_file(url, block_size="64K", connections=2, prefetch=handle), remote_model)
    finally:
        proxy.stop()
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match="connections must be"):
            pt.load_file(f"{nginx.url}/py.safetensors", connections=bad)
    for bad in (2.5, "4", True):  # LoadOptions: TypeError for a value of the wrong type
        with pytest.raises(TypeError, match="connections must be an int"):
            pt.load_file(f"{nginx.url}/py.safetensors", connections=bad)
    with pytest.raises(ValueError, match="connections"):
        pinload.prefetch([f"{nginx.url}/py.safetensors"], connections=0)


def count_fds():
    return len(os.listdir("/proc/self/fd"))


def test_no_leaks_after_200_failing_loads(remote_model, nginx):
    url_path = "/py.safetensors"
    # Data ranges fail: 404 at once for most, a reset mid-body with no
    # retries left for every fifth.
    def fault(r):
        if r["range"] is not None and r["range"][1] - r["range"][0] > 4096:
            return {"drop_after": 1000} if r["n"] % 5 == 0 else {"status": 404}

    proxy = FaultProxy(nginx.port, fault)
    os.environ["PINLOAD_REMOTE_RETRIES"] = "0"
    try:
        url = proxy.url + url_path

        def fail_once():
            with pytest.raises(pinload.Error) as info:
                pt.load_file(url, block_size="256K", connections=4)
            assert url in str(info.value)

        for _ in range(10):  # fills the connection pool
            fail_once()
        fds, threads = count_fds(), threading.active_count()
        tasks = len(os.listdir("/proc/self/task"))
        in_use = pinload.pool_stats("cpu")["in_use"]
        for _ in range(200):
            fail_once()
        # The client's pool may still gain handles (it keeps up to twice its 4 connections, each
        # handle with its connection and libcurl's socket pair); a descriptor leaked per load is 200.
        assert count_fds() <= fds + 3 * 8
        # The proxy's handler threads come and go with its connections: give them a moment.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (threading.active_count() > threads
                                               or len(os.listdir("/proc/self/task")) > tasks):
            time.sleep(0.05)
        assert threading.active_count() <= threads
        assert len(os.listdir("/proc/self/task")) <= tasks
        assert pinload.pool_stats("cpu")["in_use"] == in_use
    finally:
        os.environ.pop("PINLOAD_REMOTE_RETRIES", None)
        proxy.stop()


def test_safe_open_takes_remote_paths(remote_model, s3_env, nginx):
    expected = reference_load(str(remote_model))
    for url in (f"s3://{BUCKET}/py/model.safetensors", f"{nginx.url}/py.safetensors"):
        with pinload.safe_open(url, framework="pt") as f:  # the top-level name, as the issue used it
            assert list(f.keys()) == list(expected)
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), expected[name]), (url, name)
        with pt.safe_open(url, framework="np") as f:
            name = next(iter(expected))
            assert (f.get_tensor(name) == expected[name].numpy()).all()


def test_python_remote_errors_keep_the_servers_reason(remote_model, s3_env, nginx):
    for url, reason in ((f"s3://{BUCKET}/no/such.safetensors", "NoSuchKey"),
                        ("s3://no-such-bucket-x/m.safetensors", "NoSuchBucket"),
                        (f"{nginx.url}/no/such.safetensors", "HTTP 404")):
        for call in (pt.load_file, pinload.safe_open):
            with pytest.raises(pinload.NotFoundError) as info:
                call(url)
            assert reason in str(info.value) and "No such file or directory" not in str(info.value), \
                (call, str(info.value))
            assert info.value.file == url
