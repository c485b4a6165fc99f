"""Issue 46, defect 4: a store entry poisoned through URL parsing (Note [Canonical URLs] in
src/remote/remote_url.h).

The attacker loads 'http://127.0.0.1:EVIL#@127.0.0.1:REAL/model.safetensors' through the store,
with EVIL answering REAL's ETag. libcurl ends the host at '#' and fetches from EVIL; the store
keyed the entry by the text after the last '@', REAL's URL. The victim then loaded REAL through
the store and got EVIL's tensors, exit 0. Now the URL is parsed once, by libcurl's URL API: a
fragment (and user information) is refused, by the CLI and by the daemon alike, and the victim
gets REAL's bytes, compared with the safetensors reader's."""

import json
import socket
import subprocess

import numpy as np
import pytest
from safetensors.numpy import save_file

import stfiles
from raw_http import StoreDaemon, base_env, object_server, remote_allow_args

ETAG = b'"5d41402abc4b2a76b9719d911017c592"'  # strong: an MD5, as S3 sends


def write(path, seed):
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(20000).astype(np.float32), "b": rng.standard_normal(9).astype(np.float16)},
              str(path))
    return path


@pytest.fixture
def servers_and_daemon(tmp_path, pinload_bin):
    real = write(tmp_path / "real.safetensors", 1)
    evil = write(tmp_path / "evil.safetensors", 2)  # the same header and size, other bytes
    assert real.stat().st_size == evil.stat().st_size and real.read_bytes() != evil.read_bytes()
    real_server = object_server({"/model.safetensors": (real.read_bytes(), ETAG)})
    evil_server = object_server({None: (evil.read_bytes(), ETAG)})  # any path: libcurl asks for "/"
    env = base_env()
    daemon = StoreDaemon(pinload_bin, tmp_path, "--budget", "256M",
                         *remote_allow_args(pinload_bin, f"{real_server.url}/", f"{evil_server.url}/"), env=env).start()
    yield real, real_server, evil_server, daemon, env
    daemon.stop()
    real_server.stop()
    evil_server.stop()


def load(pinload_bin, daemon, url, env):
    return subprocess.run([pinload_bin, "load", "--store", daemon.socket, "--digest", "-v", url],
                          capture_output=True, text=True, env=env, timeout=60)


def raw_request(socket_path, body):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(socket_path)
        s.sendall(json.dumps(body).encode())
        return json.loads(s.recv(1 << 20))


def test_a_url_that_libcurl_reads_from_another_host_cannot_poison_the_store(pinload_bin, servers_and_daemon):
    real, real_server, evil_server, daemon, env = servers_and_daemon
    real_url = f"{real_server.url}/model.safetensors"
    poisoned = f"{evil_server.url}#@127.0.0.1:{real_server.port}/model.safetensors"
    # The attacker, through the CLI: refused before anything is fetched or stored.
    r = load(pinload_bin, daemon, poisoned, env)
    assert r.returncode == 1, r
    assert "fragment" in r.stderr and f"127.0.0.1:{evil_server.port}" in r.stderr, r.stderr
    # The attacker, straight to the daemon (a client that skips the CLI's checks): refused too.
    size = real.stat().st_size
    for url in (poisoned, f"http://x:y@127.0.0.1:{evil_server.port}/model.safetensors"):
        reply = raw_request(daemon.socket, {"op": "get_remote", "url": url, "version": ETAG.decode(), "size": size})
        assert reply["ok"] is False, reply
    assert daemon.alive()
    # The victim: REAL's bytes, from the store.
    r = load(pinload_bin, daemon, real_url, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == stfiles.expected_digest(real)
    assert "1 from the store" in r.stderr, r.stderr


def test_one_object_spelled_two_ways_is_one_entry(pinload_bin, servers_and_daemon):
    """The key is the URL libcurl fetches: a default port, the host's case and dot segments do not
    make another entry (nor do they reach another object)."""
    real, real_server, _, daemon, env = servers_and_daemon
    first = load(pinload_bin, daemon, f"{real_server.url}/model.safetensors", env)
    second = load(pinload_bin, daemon, f"http://127.0.0.1:{real_server.port}/x/../model.safetensors", env)
    for r in (first, second):
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == stfiles.expected_digest(real)
    status = json.loads(subprocess.run([pinload_bin, "store", "status", "--socket", daemon.socket, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert (status["misses"], status["hits"]) == (1, 1), status
