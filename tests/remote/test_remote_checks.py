"""What the remote client sends and what it accepts, where a node store's daemon fetches for its
clients (issue 46), against raw-socket servers and a real daemon:
- an ETag is sent back in If-Match, and the daemon sends the one its client names: one holding
  CR LF added headers of the client's choosing to the daemon's request. It is refused now;
- the size a client names is checked against the object on every range;
- an answer without an ETag confirms no version: a load that read its header at one ETag took
  such answers' bytes as that version's."""

import json
import re
import socket
import subprocess

import numpy as np
from safetensors.numpy import save_file

import stfiles
from raw_http import RawServer, StoreDaemon, base_env, http_answer, ranged_answer, remote_allow_args

ETAG = b'"5d41402abc4b2a76b9719d911017c592"'


def test_a_clients_etag_cannot_add_headers_to_the_daemons_request(tmp_path, pinload_bin):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(path))
    data = path.read_bytes()
    seen = []

    def answer(request):
        seen.append(request["headers"])
        return http_answer(*ranged_answer(data, request, ETAG))

    server = RawServer(answer)
    daemon = StoreDaemon(pinload_bin, tmp_path, "--budget", "64M", *remote_allow_args(pinload_bin, server.url + "/"),
                         env=base_env()).start()
    try:
        for version in (ETAG[:-1] + b'\r\nX-Injected: yes\r\nX-Other: "', ETAG[:-1] + b'\nX-Injected: yes"'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(daemon.socket)
                s.sendall(json.dumps({"op": "get_remote", "url": f"{server.url}/m.safetensors",
                                      "version": version.decode(), "size": len(data)}).encode())
                reply = json.loads(s.recv(1 << 20))
            assert reply["ok"] is False, reply
        assert daemon.alive()
        assert not any("x-injected" in headers for headers in seen), seen
    finally:
        daemon.stop()
        server.stop()


def test_the_size_a_client_names_is_checked_against_the_object(tmp_path, pinload_bin):
    """The daemon fetches the size its client names; a server whose Content-Range gives no total
    ('bytes a-b/*') cannot confirm it, so the fetch fails rather than storing a cut-short object."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(4000, dtype=np.float32)}, str(path))
    data = path.read_bytes()

    def answer(request):
        status, headers, body = ranged_answer(data, request, ETAG)
        return http_answer(status, [(n, re.sub(rb"/\d+$", b"/*", v) if n == b"Content-Range" else v)
                                    for n, v in headers], body)

    server = RawServer(answer)
    daemon = StoreDaemon(pinload_bin, tmp_path, "--budget", "64M", *remote_allow_args(pinload_bin, server.url + "/"),
                         env=base_env()).start()
    try:
        for size in (len(data) // 2, len(data) - 1):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(daemon.socket)
                s.sendall(json.dumps({"op": "get_remote", "url": f"{server.url}/m.safetensors",
                                      "version": ETAG.decode(), "size": size}).encode())
                reply = json.loads(s.recv(1 << 20))
            assert reply["ok"] is False and reply["error"]["code"] == "io", reply
        assert daemon.alive()
    finally:
        daemon.stop()
        server.stop()


def test_an_answer_without_an_etag_confirms_no_version(tmp_path, pinload_bin):
    """The header is read at version A (ETag X); the object is then replaced by B (same header,
    other bytes), and the server answers the data ranges without an ETag (and ignores If-Match).
    f348012 returned B's bytes as A's tensors, exit 0."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.arange(40000, dtype=np.float32)}, str(a))
    save_file({"w": -np.arange(40000, dtype=np.float32)}, str(b))
    old, new = a.read_bytes(), b.read_bytes()
    assert len(old) == len(new)

    def answer(request):
        if request["n"] < 2:  # the header reads: 8 bytes, then the header
            return http_answer(*ranged_answer(old, request, ETAG))
        status, headers, body = ranged_answer(new, request, ETAG)
        return http_answer(status, [(n, v) for n, v in headers if n not in (b"ETag", b"Last-Modified")], body)

    server = RawServer(answer)
    try:
        r = subprocess.run([pinload_bin, "load", "--digest", "-q", f"{server.url}/m.safetensors"], capture_output=True,
                           text=True, env=base_env(PINLOAD_REMOTE_RETRIES="0"), timeout=60)
        assert r.returncode == 1, r
        assert "no ETag" in r.stderr and stfiles.expected_digest(b)[0] not in r.stdout, r.stderr
    finally:
        server.stop()
