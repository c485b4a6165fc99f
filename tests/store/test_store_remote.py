"""Remote entries of the node store (Note [Remote store entries] in include/pinload/store.h), with a
real S3 server (SeaweedFS): the daemon fetches an object once, at the ETag whose header the client
read with its own credentials, and every later client maps that copy."""

import json
import socket
import sys
from pathlib import Path

import pytest

from conftest import Daemon
from test_store import CLIENT_ENV, cli_digests, digests, status, write_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))
import servers  # noqa: E402

BUCKET = "store-models"


@pytest.fixture(scope="module")
def weed():
    try:
        s = servers.Seaweed()
    except servers.ServerUnavailable as e:
        pytest.skip(f"server cannot start: {e}")
    s.client().create_bucket(Bucket=BUCKET)
    yield s
    s.cleanup()


@pytest.fixture
def model(tmp_path, weed):
    path = write_model(tmp_path / "m.safetensors", 24, 31)
    weed.client().upload_file(str(path), BUCKET, "m.safetensors")
    return path


@pytest.fixture
def remote_daemon(tmp_path, pinload_bin, weed):
    # The daemon's own credentials: it fetches with them what the operator allowed for every client
    # (docs/store.md, the trust model).
    d = Daemon(pinload_bin, tmp_path, "--budget", "1G", "--remote-allow", f"s3://{BUCKET}/",
               env={**CLIENT_ENV, **weed.env()}).start()
    yield d
    d.stop()


def remote_digests(pinload_bin, weed, socket_path, url, *extra, **env):
    """`pinload load --store` of `url` with the client's own credentials (weed's, or as overridden)."""
    return cli_digests(pinload_bin, socket_path, url, "-v", *extra, check=False, env={**CLIENT_ENV, **weed.env(**env)})


def raw_request(socket_path, body: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(socket_path)
        s.sendall(json.dumps(body).encode())
        return json.loads(s.recv(70000))


def test_the_daemon_fetches_an_object_once_and_clients_map_it(pinload_bin, weed, model, remote_daemon):
    url = f"s3://{BUCKET}/m.safetensors"
    expected = digests(model)
    got, r = remote_digests(pinload_bin, weed, remote_daemon.socket, url)
    assert r.returncode == 0, r.stderr
    assert got == expected and "1 from the store" in r.stderr, r.stderr
    got, r = remote_digests(pinload_bin, weed, remote_daemon.socket, url)
    assert r.returncode == 0 and got == expected, r.stderr
    s = status(pinload_bin, remote_daemon.socket)
    assert (s["misses"], s["hits"], s["reads"]) == (1, 1, 1)
    assert s["bytes_read"] == model.stat().st_size
    assert s["entries"][0]["path"] == url


def test_a_new_version_is_a_new_entry(pinload_bin, weed, model, remote_daemon, tmp_path):
    url = f"s3://{BUCKET}/m.safetensors"
    got, r = remote_digests(pinload_bin, weed, remote_daemon.socket, url)
    assert r.returncode == 0 and got == digests(model), r.stderr
    other = write_model(tmp_path / "m2.safetensors", 24, 32)
    weed.client().upload_file(str(other), BUCKET, "m.safetensors")
    got, r = remote_digests(pinload_bin, weed, remote_daemon.socket, url)
    assert r.returncode == 0 and got == digests(other), r.stderr
    s = status(pinload_bin, remote_daemon.socket)
    assert s["misses"] == 2 and s["reads"] == 2 and len(s["entries"]) == 2


def test_a_client_without_access_gets_nothing(pinload_bin, weed, model, remote_daemon):
    url = f"s3://{BUCKET}/m.safetensors"
    assert remote_digests(pinload_bin, weed, remote_daemon.socket, url)[1].returncode == 0  # now in the store
    # Wrong credentials: the client's own header read fails, so it never asks the store.
    _, r = remote_digests(pinload_bin, weed, remote_daemon.socket, url, AWS_SECRET_ACCESS_KEY="wrong-secret-key-0000")
    assert r.returncode != 0 and "m.safetensors" in r.stderr
    assert status(pinload_bin, remote_daemon.socket)["hits"] == 0
    # A request with an ETag the object does not have: the daemon's If-Match fetch fails and
    # nothing is served; a weak ETag pins no version and is refused outright.
    size = model.stat().st_size
    reply = raw_request(remote_daemon.socket, {"op": "get_remote", "url": f"s3://{BUCKET}/m.safetensors",
                                               "version": '"0123456789abcdef0123456789abcdef"', "size": size})
    assert reply["ok"] is False and reply["error"]["code"] in ("io", "not_found"), reply
    reply = raw_request(remote_daemon.socket, {"op": "get_remote", "url": f"s3://{BUCKET}/m.safetensors",
                                               "version": 'W/"abc"', "size": size})
    assert reply["ok"] is False and reply["error"]["code"] == "invalid_argument", reply
    s = status(pinload_bin, remote_daemon.socket)
    assert s["reads"] == 1 and len(s["entries"]) == 1


def test_a_daemon_that_cannot_fetch_leaves_the_client_to_load_it(pinload_bin, weed, model, tmp_path):
    # No credentials in the daemon's environment: its fetch is refused, the client warns and
    # reads the object itself; with --store-required the refusal is the load's error.
    env = {k: v for k, v in CLIENT_ENV.items() if not k.startswith("AWS_")}
    d = Daemon(pinload_bin, tmp_path, "--budget", "1G", "--remote-allow", f"s3://{BUCKET}/",
               env={**env, "AWS_ENDPOINT_URL": weed.endpoint}).start()
    try:
        url = f"s3://{BUCKET}/m.safetensors"
        got, r = remote_digests(pinload_bin, weed, d.socket, url)
        assert r.returncode == 0 and got == digests(model), r.stderr
        assert "without the store" in r.stderr
        _, r = remote_digests(pinload_bin, weed, d.socket, url, "--store-required")
        assert r.returncode != 0 and "m.safetensors" in r.stderr
        assert status(pinload_bin, d.socket)["entries"] == []
    finally:
        d.stop()


def test_a_daemon_fetches_with_its_credentials_only_under_an_allowed_prefix(pinload_bin, weed, model, tmp_path):
    """No confused deputy: a daemon whose credentials can read the bucket, started without
    --remote-allow, fetches nothing for a client; the client reads the object itself, even under
    --store-required (a refusal is not a failure), and a raw request is told to read it itself."""
    d = Daemon(pinload_bin, tmp_path, "--budget", "1G", env={**CLIENT_ENV, **weed.env()}).start()
    try:
        url = f"s3://{BUCKET}/m.safetensors"
        got, r = remote_digests(pinload_bin, weed, d.socket, url, "--store-required")
        assert r.returncode == 0 and got == digests(model), r.stderr
        assert "0 from the store" in r.stderr, r.stderr
        etag = weed.client().head_object(Bucket=BUCKET, Key="m.safetensors")["ETag"]
        for asked in (url, url + "?X-Amz-Signature=0&X-Amz-Credential=x&X-Amz-Date=20260101T000000Z"):
            # An s3:// path is signed with the daemon's own credentials: a query there is no presigned URL.
            reply = raw_request(d.socket, {"op": "get_remote", "url": asked, "version": etag,
                                           "size": model.stat().st_size})
            assert reply["ok"] is False and reply["read_yourself"] is True, reply
        assert status(pinload_bin, d.socket)["entries"] == []
    finally:
        d.stop()
