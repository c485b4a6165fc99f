"""The node store as a security boundary (Note [The store's security boundary] in src/store/server.cc,
docs/store.md's trust model): no request, server or other user crashes the daemon, poisons an entry
or reads through it. Each test reproduces one attack with real processes (the daemon, `pinload`
clients, another uid, a hostile HTTP server) and checks bytes against safetensors' own reader."""

import array
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import Daemon
from object_server import ObjectServer
from test_store import (CLIENT_ENV, as_user, cli_digests, digests, open_folder, other_user,  # noqa: F401 (fixtures)
                        status, write_model)


def request(socket_path, body, fds=(), raw=None):
    """One record (a JSON body, or `raw` bytes) with `fds`; the daemon's reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(60)
        s.connect(socket_path)
        data = raw if raw is not None else json.dumps(body).encode()
        socket.send_fds(s, [data], list(fds)) if fds else s.sendall(data)
        msg, got, _, _ = socket.recv_fds(s, 70000, 4)
        for fd in got:
            os.close(fd)
        return json.loads(msg)


def alive_and_serving(pinload_bin, daemon, model):
    """The daemon runs, and a plain load through it maps the file's bytes."""
    assert daemon.proc.poll() is None, daemon.log.read_text()
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v", "--store-required")
    assert got == digests(model) and "1 from the store" in r.stderr, r.stderr


def safetensors_bytes(header: bytes, data: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


# ---- 1: a dtype request whose file header holds bytes that are not UTF-8 ----

@pytest.mark.parametrize("header", [
    b'{"w\xff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    b'{"w":{"dtype":"F\xfe32","shape":[1],"data_offsets":[0,4]}}',
    b'{"__metadata__":{"k":"\xc3"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"\x80\x81":7}',
])
def test_a_converting_get_of_a_header_that_is_not_utf8_is_a_typed_error(tmp_path, pinload_bin, daemon, header):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(safetensors_bytes(header, b"\0\0\x80\x3f"))
    with open(bad, "rb") as f:
        reply = request(daemon.socket, {"op": "get", "path": str(bad), "dtype": {"to": "BF16"}}, [f.fileno()])
    assert reply["ok"] is False and reply["error"]["code"] in ("invalid_file", "invalid_argument"), reply
    alive_and_serving(pinload_bin, daemon, write_model(tmp_path / "m.safetensors", 1, 40))


# ---- 2: a remote fill whose server answers with bytes that are not UTF-8 ----

@pytest.mark.parametrize("fault", [
    {"headers": [(b"Content-Range", b"bytes 0-\xff\xfe/12")]},
    {"headers": [(b"ETag", b'"\xff\xc3\x28abc"')]},
    {"status": 403, "headers": [(b"Content-Type", b"application/xml")],
     "body": b"<Error><Code>Access\xffDenied</Code><Message>\xfe\x80</Message></Error>"},
    {"status": 404, "body": b"\xff" * 300},
])
def test_a_server_answer_that_is_not_utf8_fails_the_fill_not_the_daemon(tmp_path, pinload_bin, fault):
    model = write_model(tmp_path / "m.safetensors", 1, 41)
    data = model.read_bytes()
    # The client's own reads are answered well; the daemon's fill (the first large range after the
    # client's header reads) gets the fault.
    armed = []

    def pick(first, last):
        if last - first + 1 < 65536:
            armed.append(True)
        elif armed:
            armed.clear()
            return fault

    server = ObjectServer(data, fault=pick)
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/").start()
    try:
        _, r = cli_digests(pinload_bin, d.socket, f"{server.url}/m.safetensors", "--store-required", check=False)
        assert r.returncode == 1 and "m.safetensors" in r.stderr, r.stderr
        assert d.proc.poll() is None, d.log.read_text()
        # Not required: the client reads the object itself (its ranges are answered well).
        got, r = cli_digests(pinload_bin, d.socket, f"{server.url}/m.safetensors", check=False)
        assert r.returncode == 0 and got == digests(model), r.stderr
        assert status(pinload_bin, d.socket)["entries"] == []
        alive_and_serving(pinload_bin, d, model)
    finally:
        d.stop()
        server.stop()


# ---- 3: refused peers hold no thread and no slot; connections are bounded per uid ----

HOLD_CONNECTIONS = textwrap.dedent("""
    import resource, socket, sys
    n, path = int(sys.argv[1]), sys.argv[2]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        held.append(s)
    print(len(held), flush=True)
    sys.stdin.read()
""")


def threads_of(pid) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_a_refused_uid_opening_1100_connections_does_not_stop_an_allowed_client(open_folder, pinload_bin,
                                                                                 other_user):
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the descriptor limit's hard limit is under 1200")
    model = write_model(open_folder / "m.safetensors", 1, 42)
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666").start()
    flood = subprocess.Popen(as_user(other_user, [sys.executable, "-c", HOLD_CONNECTIONS, "1100", d.socket]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "1100"
        time.sleep(0.5)  # the daemon has accepted what it will
        assert threads_of(d.proc.pid) < 64  # no thread per refused peer
        alive_and_serving(pinload_bin, d, model)
        s = status(pinload_bin, d.socket)
        assert s["refused"] >= 1000 and s["clients"] == 0, s
    finally:
        flood.stdin.close()
        flood.wait(30)
        d.stop()


def test_connections_over_the_per_uid_bound_get_a_typed_busy_reply(open_folder, pinload_bin, other_user):
    model = write_model(open_folder / "m.safetensors", 1, 43)
    model.chmod(0o644)
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666", "--allow-uid",
               str(other_user.pw_uid), "--max-connections-per-uid", "4").start()
    flood = subprocess.Popen(as_user(other_user, [sys.executable, "-c", HOLD_CONNECTIONS, "4", d.socket]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "4"
        time.sleep(0.3)
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "--store-required", "-q",
                                                str(model)]), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "busy" in r.stderr and "per-uid" in r.stderr, r.stderr
        # Not required: the other uid's load reads the file itself; root is not held up.
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "-q", str(model)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "busy" in r.stderr, r.stderr
        alive_and_serving(pinload_bin, d, model)
        assert status(pinload_bin, d.socket)["busy"] >= 2
    finally:
        flood.stdin.close()
        flood.wait(30)
        d.stop()


def test_connections_over_the_total_bound_get_a_typed_busy_reply(open_folder, pinload_bin, other_user):
    model = write_model(open_folder / "m.safetensors", 1, 45)
    model.chmod(0o644)
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666", "--allow-uid",
               str(other_user.pw_uid), "--max-connections", "4", "--max-connections-per-uid", "64").start()
    flood = subprocess.Popen(as_user(other_user, [sys.executable, "-c", HOLD_CONNECTIONS, "4", d.socket]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "4"
        time.sleep(0.3)
        # Every slot is taken: root's load too gets "busy" (not a reset), and reads the file itself.
        r = subprocess.run([pinload_bin, "load", "--store", d.socket, "--store-required", "-q", str(model)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "busy" in r.stderr, r.stderr
        r = subprocess.run([pinload_bin, "load", "--store", d.socket, "-q", str(model)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        flood.stdin.close()
        flood.wait(30)
    try:
        time.sleep(0.3)  # the flood's connections closed: slots are free again
        alive_and_serving(pinload_bin, d, model)
    finally:
        d.stop()


# ---- 5: no confused deputy; 9: the size is part of the key and checked ----

@pytest.fixture
def object_model(tmp_path):
    return write_model(tmp_path / "o.safetensors", 1, 44)


def test_a_version_the_daemon_cannot_verify_is_neither_fetched_nor_served(tmp_path, pinload_bin, object_model):
    data = object_model.read_bytes()
    server = ObjectServer(data, etag=None)  # no ETag: nothing pins a version
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/").start()
    try:
        reply = request(d.socket, {"op": "get_remote", "url": f"{server.url}/o.safetensors", "version": '"guess"',
                                   "size": len(data)})
        assert reply["ok"] is False and reply.get("read_yourself") is True, reply
        assert status(pinload_bin, d.socket)["entries"] == []
        alive_and_serving(pinload_bin, d, object_model)
    finally:
        d.stop()
        server.stop()


def test_the_daemon_fetches_only_under_an_allowed_prefix(tmp_path, pinload_bin, object_model):
    data = object_model.read_bytes()
    server = ObjectServer(data)
    url = f"{server.url}/models/o.safetensors"
    etag = server.etag.decode()
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/other/").start()
    try:
        reply = request(d.socket, {"op": "get_remote", "url": url, "version": etag, "size": len(data)})
        assert reply["ok"] is False and reply.get("read_yourself") is True, reply
        assert server.requests == []  # nothing fetched for the client
        # A load reads the object itself, even where the store is required: a refusal is not a failure.
        got, r = cli_digests(pinload_bin, d.socket, url, "-v", "--store-required")
        assert got == digests(object_model) and "0 from the store" in r.stderr, r.stderr
        assert status(pinload_bin, d.socket)["entries"] == []
    finally:
        d.stop()
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/models").start()
    try:
        got, r = cli_digests(pinload_bin, d.socket, url, "-v", "--store-required")
        assert got == digests(object_model) and "1 from the store" in r.stderr, r.stderr
        (entry,) = status(pinload_bin, d.socket)["entries"]
        assert entry["path"] == url
        # "/models" allows /models/..., not /models-private/...
        reply = request(d.socket, {"op": "get_remote", "url": f"{server.url}/models-private/o.safetensors",
                                   "version": etag, "size": len(data)})
        assert reply.get("read_yourself") is True, reply
    finally:
        d.stop()
        server.stop()


def test_a_size_that_is_not_the_objects_is_refused_and_never_wraps(tmp_path, pinload_bin, object_model):
    data = object_model.read_bytes()
    server = ObjectServer(data)
    url, etag = f"{server.url}/o.safetensors", server.etag.decode()
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/").start()
    try:
        for size in (2**64 - 1, 2**64 - 4096, len(data) + 1, len(data) - 1, 1):
            reply = request(d.socket, {"op": "get_remote", "url": url, "version": etag, "size": size})
            assert reply["ok"] is False and reply["error"]["code"] in ("out_of_memory", "io"), (size, reply)
        assert status(pinload_bin, d.socket)["entries"] == []
        reply = request(d.socket, {"op": "get_remote", "url": url, "version": etag, "size": len(data)})
        assert reply["ok"] is True and reply["bytes"] == len(data), reply
        (entry,) = status(pinload_bin, d.socket)["entries"]
        assert entry["bytes"] == len(data)
    finally:
        d.stop()
        server.stop()


# ---- 6: the daemon reads only through a descriptor opened for reading ----

SEND_O_PATH = textwrap.dedent("""
    import json, os, socket, sys
    path, sock = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_PATH)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sock)
    socket.send_fds(s, [json.dumps({"op": "get", "path": path, "hold": False}).encode()], [fd])
    msg, fds, _, _ = socket.recv_fds(s, 70000, 4)
    reply = json.loads(msg)
    if fds:
        reply["content"] = os.pread(fds[0], 64, 0).rstrip(b"\\0").decode("latin-1")
    print(json.dumps(reply))
""")


@pytest.mark.parametrize("content", [b"secret", b"x" * 300])
def test_an_o_path_descriptor_of_a_file_the_client_cannot_read_is_refused(open_folder, pinload_bin, other_user,
                                                                            content):
    secret = open_folder / "secret.bin"
    secret.write_bytes(content)
    secret.chmod(0o600)  # root's alone
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666", "--allow-uid",
               str(other_user.pw_uid)).start()
    try:
        r = subprocess.run(as_user(other_user, [sys.executable, "-c", SEND_O_PATH, str(secret), d.socket]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        reply = json.loads(r.stdout)
        assert reply["ok"] is False and "O_PATH" in reply["error"]["message"], reply
        assert "content" not in reply
        assert status(pinload_bin, d.socket)["entries"] == []
    finally:
        d.stop()


# ---- 7: a deleted file's inode reused; 8: a rewrite with its mtime set back ----

def same_layout(path: Path, seed: int):
    """A file of the same header (names, shapes, offsets) and size as any other seed's, other bytes."""
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(64 << 10, dtype=np.float32)}, str(path))
    return path


def test_a_file_rewritten_in_place_with_its_mtime_restored_is_a_new_entry(tmp_path, pinload_bin, daemon):
    model = same_layout(tmp_path / "m.safetensors", 45)
    old, _ = cli_digests(pinload_bin, daemon.socket, model, "--store-required")
    assert old == digests(model)
    before = os.stat(model)
    new = same_layout(tmp_path / "new.safetensors", 46).read_bytes()
    with open(model, "r+b") as f:  # in place: the same inode
        f.write(new)
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(model)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    got, _ = cli_digests(pinload_bin, daemon.socket, model, "--store-required")
    assert got == digests(model) != old
    assert status(pinload_bin, daemon.socket)["misses"] == 2


REUSE_INODE = textwrap.dedent("""
    import os, sys
    folder, inode, size, mtime_ns, data = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    payload = open(data, "rb").read()
    assert len(payload) == size
    kept = []
    for i in range(200):
        path = os.path.join(folder, f"mine{i}.safetensors")
        with open(path, "wb") as f:
            f.write(payload)
        if os.stat(path).st_ino == inode:
            os.utime(path, ns=(mtime_ns, mtime_ns))
            print(path)
            break
        kept.append(path)  # kept, so the next file takes another inode
    for path in kept:
        os.unlink(path)
""")


def test_a_deleted_files_inode_reused_by_another_uid_is_a_new_entry(open_folder, pinload_bin, other_user):
    folder = open_folder / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    secret = same_layout(folder / "secret.safetensors", 47)
    secret.chmod(0o600)
    theirs = same_layout(open_folder / "theirs.safetensors", 48)
    theirs.chmod(0o644)
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666", "--allow-uid",
               str(other_user.pw_uid)).start()
    try:
        assert subprocess.run([pinload_bin, "store", "warm", "--socket", d.socket, str(secret)]).returncode == 0
        st = os.stat(secret)
        secret_digests = digests(secret)
        secret.unlink()
        r = subprocess.run(as_user(other_user, [sys.executable, "-c", REUSE_INODE, str(folder), str(st.st_ino),
                                                str(st.st_size), str(st.st_mtime_ns), str(theirs)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        if not r.stdout.strip():
            pytest.skip("the filesystem gave no new file the deleted one's inode")
        mine = Path(r.stdout.strip())
        m = os.stat(mine)
        assert (m.st_ino, m.st_size, m.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "--store-required",
                                                "--digest", "-q", str(mine)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        got = {l.split("\t")[0]: l.split("\t")[3] for l in r.stdout.splitlines()}
        assert got != secret_digests and got == digests(theirs)
    finally:
        d.stop()


# ---- privacy between users: status shows a uid its own entries ----

def test_status_shows_a_uid_only_the_entries_it_was_served(open_folder, pinload_bin, other_user):
    rootish = write_model(open_folder / "root.safetensors", 1, 49)
    theirs = write_model(open_folder / "theirs.safetensors", 1, 50)
    for p in (rootish, theirs):
        p.chmod(0o644)
    d = Daemon(pinload_bin, open_folder, "--budget", "256M", "--socket-mode", "0666", "--allow-uid",
               str(other_user.pw_uid)).start()
    try:
        subprocess.run([pinload_bin, "store", "warm", "--socket", d.socket, str(rootish)], check=True)

        def their_status():
            r = subprocess.run(as_user(other_user, [pinload_bin, "store", "status", "--socket", d.socket, "--json"]),
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            return [e["path"] for e in json.loads(r.stdout)["entries"]]

        assert their_status() == []
        r = subprocess.run(as_user(other_user, [pinload_bin, "store", "warm", "--socket", d.socket, str(theirs)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert their_status() == [str(theirs)]
        assert sorted(e["path"] for e in status(pinload_bin, d.socket)["entries"]) == sorted([str(rootish), str(theirs)])
        # Evicting everything drops only what that uid was served.
        r = subprocess.run(as_user(other_user, [pinload_bin, "store", "evict", "--socket", d.socket]),
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "1 entry dropped" in r.stderr, r.stderr
        assert [e["path"] for e in status(pinload_bin, d.socket)["entries"]] == [str(rootish)]
        # The text form counts in GB, as `load` does.
        text = subprocess.run([pinload_bin, "store", "status", "--socket", d.socket], capture_output=True, text=True,
                              timeout=30).stdout
        assert "GB of 0.268 GB budget" in text, text
    finally:
        d.stop()


# ---- memory for headers is counted against the budget ----

def vm_hwm(pid) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_concurrent_gets_of_a_huge_header_stay_within_the_budget(tmp_path, pinload_bin):
    big = tmp_path / "big.safetensors"
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    big.write_bytes(safetensors_bytes(header + b" " * (40 << 20), b"\0\0\x80\x3f"))
    d = Daemon(pinload_bin, tmp_path, "--budget", "96M").start()
    try:
        base = vm_hwm(d.proc.pid)
        replies = []

        def get():
            with open(big, "rb") as f:
                replies.append(request(d.socket, {"op": "get", "path": str(big), "hold": False}, [f.fileno()]))

        threads = [threading.Thread(target=get) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r["ok"] or r["error"]["code"] == "out_of_memory" for r in replies), replies
        assert any(r["ok"] for r in replies)
        # The entry (40 MiB) and one header in flight at a time, not 16 headers (640 MiB).
        assert vm_hwm(d.proc.pid) - base < 200 << 20, (vm_hwm(d.proc.pid), base)
        assert d.proc.poll() is None
    finally:
        d.stop()


# ---- the fill reads through the client's descriptors: direct where the client opened one O_DIRECT ----

def test_a_cold_file_is_filled_direct_through_the_clients_descriptor(tmp_path, pinload_bin):
    daemon = Daemon(pinload_bin, tmp_path, "--budget", "256M", env={**os.environ, "PINLOAD_LOG_LEVEL": "info"}).start()
    try:
        check_direct_fill(tmp_path, pinload_bin, daemon)
    finally:
        daemon.stop()


def check_direct_fill(tmp_path, pinload_bin, daemon):
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{kind} keeps its files in memory: no cold file to read direct")
    model = write_model(tmp_path / "m.safetensors", 16, 52)
    expected = digests(model)
    fd = os.open(model, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    finally:
        os.close(fd)
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v", "--store-required")
    assert got == expected and "1 from the store" in r.stderr, r.stderr
    log = daemon.log.read_text()
    assert f"store: read {model} (" in log and ", direct," in log, log


def test_a_presigned_url_is_no_licence_to_fetch(tmp_path, pinload_bin, object_model):
    """A query that looks presigned proves nothing the daemon can check: outside --remote-allow the
    client reads it itself, and no reply tells it the object's ETag or size (defect 5's oracle)."""
    data = object_model.read_bytes()
    server = ObjectServer(data)  # ignores the query, as a server that the client cannot reach might
    url, etag = f"{server.url}/o.safetensors", server.etag.decode()
    signed = url + "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=k&X-Amz-Date=20260101T000000Z&X-Amz-Signature="
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M").start()  # no --remote-allow
    try:
        for version, size in ((etag, len(data)), ('"0123456789abcdef"', len(data)), (etag, 1)):
            reply = request(d.socket, {"op": "get_remote", "url": signed + "aa", "version": version, "size": size})
            assert reply["ok"] is False and reply.get("read_yourself") is True, reply
            assert etag.strip('"') not in json.dumps(reply) and str(len(data)) not in json.dumps(reply), reply
        assert server.requests == [], "the daemon fetched a URL outside its --remote-allow prefixes"
    finally:
        d.stop()
    # Under an allowed prefix the same URL is fetched, and its entry is keyed with its query.
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--remote-allow", server.url + "/").start()
    try:
        reply = request(d.socket, {"op": "get_remote", "url": signed + "aa", "version": etag, "size": len(data)})
        assert reply["ok"] is True and reply["hit"] is False, reply
        reply = request(d.socket, {"op": "get_remote", "url": signed + "bb", "version": etag, "size": len(data)})
        assert reply["ok"] is True and reply["hit"] is False, reply
        reply = request(d.socket, {"op": "get_remote", "url": signed + "aa", "version": etag, "size": len(data)})
        assert reply["ok"] is True and reply["hit"] is True, reply
    finally:
        d.stop()
        server.stop()
