"""A seeded, bounded fuzzer of the node store's wire protocol against the real daemon (Note [The
store's security boundary] in src/store/server.cc): mutated and hand-made records, bytes that are
not UTF-8 anywhere, oversized fields, wrong types, and descriptors of every kind. Every record gets
a typed answer (or its connection is closed), and afterwards the daemon serves a normal load with
the file's bytes and holds no more descriptors or threads than before."""

import json
import os
import random
import select
import socket
import time

import pytest

from test_store import cli_digests, digests, status, wait_for, write_model
from test_store_security import threads_of

SEED, RECORDS = 46, 1500


def values(rng: random.Random):
    """A value of a random JSON type, hostile where it can be."""
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 4096, 2**40])
    if kind == 1:
        return rng.choice([0.5, -1e308, 1e308, 1e-300])
    if kind == 2:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 32), rng.randrange(0x80, 0x800),
                                        rng.randrange(0xE000, 0x10FFFF)])) for _ in range(rng.randrange(40)))
    if kind == 3:
        return "x" * rng.choice([4097, 20000, 60000])
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice([True, False])
    if kind == 6:
        return [values(rng) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {"to": rng.choice(["BF16", "F16", "F32", "I8", "", "bf16"]), "keep": values(rng), "prefix": values(rng)}
    if kind == 8:
        return rng.choice(["http://127.0.0.1:1#@127.0.0.1:2/m.safetensors", "http://user:pw@127.0.0.1:1/m",
                           "s3://", "s3://b/k?X-Amz-Credential=1", "http://[::1", "http://h/%ff%00", "file:///etc/passwd",
                           "http://127.0.0.1:1/m\r\nX: y", "HTTP://H:80/./a/../m"])
    if kind == 9:
        return rng.choice(['"0123456789abcdef0123456789abcdef"', 'W/"x"', "guess", '""', '"\\u0000"'])
    if kind == 10:
        deep = 0
        for _ in range(rng.choice([10, 500, 5000])):
            deep = [deep]
        return deep
    return {rng.choice(["op", "path", "", "\u00e9", "\x00"]): values(rng)}


TEMPLATES = [
    lambda m: {"op": "get", "path": m, "hold": True},
    lambda m: {"op": "get", "path": m, "hold": False, "dtype": {"to": "BF16", "keep": ["b"], "prefix": ""}},
    lambda m: {"op": "get_remote", "url": "http://127.0.0.1:1/m.safetensors",
               "version": '"0123456789abcdef0123456789abcdef"', "size": 4096, "hold": True},
    lambda m: {"op": "status"},
    lambda m: {"op": "evict"},
    lambda m: {"op": "release"},
]


def record(rng: random.Random, model: str) -> bytes:
    """One record: a template with fields replaced or added, raw bytes, or a valid body mutated byte by byte."""
    body = rng.choice(TEMPLATES)(model)
    kind = rng.randrange(6)
    if kind <= 2:
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(list(body) + ["op", "path", "url", "size", "version", "dtype", "hold", "x"])] = values(rng)
        try:
            data = json.dumps(body).encode()
        except (ValueError, RecursionError):
            data = b"[" * 30000
        return data[:70000] if rng.random() < 0.95 else data + b" " * 70000
    if kind == 3:  # not UTF-8 inside a string, a key, or between tokens
        bad = bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 6)))
        return rng.choice([b'{"op": "get", "path": "' + bad + b'"}', b'{"op": "' + bad + b'"}',
                           b'{"' + bad + b'": 1, "op": "status"}', b'{"op": "status"}' + bad,
                           b'{"op": "get_remote", "url": "http://h/' + bad + b'", "version": "\\"a\\"", "size": 1}'])
    if kind == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    data = bytearray(json.dumps(body).encode())
    for _ in range(rng.randrange(1, 6)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


@pytest.fixture
def descriptors(tmp_path, daemon):
    """Descriptors of every kind a client could pass."""
    model = write_model(tmp_path / "m.safetensors", 1, 51)
    (tmp_path / "w.bin").write_bytes(b"w" * 100)
    os.mkfifo(tmp_path / "fifo")
    r, w = os.pipe()
    a, b = socket.socketpair()
    memfd = os.memfd_create("fuzz")
    os.write(memfd, b"x" * 5000)
    ep = select.epoll()
    fds = {
        "file": os.open(model, os.O_RDONLY),
        "o_path": os.open(model, os.O_PATH),
        "write_only": os.open(tmp_path / "w.bin", os.O_WRONLY),
        "directory": os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY),
        "pipe_read": r, "pipe_write": w, "socket": a.fileno(), "dev_null": os.open("/dev/null", os.O_RDONLY),
        "memfd": memfd, "eventfd": os.eventfd(0), "epoll": ep.fileno(),
        "fifo": os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK),
        "listening": daemon_socket_fd(daemon.socket),
    }
    yield model, fds
    for name, fd in fds.items():
        if name not in ("socket", "epoll"):
            os.close(fd)
    a.close(), b.close(), ep.close()


def daemon_socket_fd(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s.detach()


def test_hostile_records_get_typed_answers_and_leak_nothing(pinload_bin, daemon, descriptors):
    model, fds = descriptors
    cli_digests(pinload_bin, daemon.socket, model)  # the entry exists: its memfd is the daemon's from now on
    # One connection stays open: the descriptor "listening", a client socket of the daemon's own.
    wait_for(lambda: status(pinload_bin, daemon.socket)["clients"] == 1, "idle")
    baseline_fds, baseline_threads = daemon.fds(), threads_of(daemon.proc.pid)
    rng = random.Random(SEED)
    kinds = list(fds.values())
    conn = None
    answered = 0
    deadline = time.monotonic() + 60
    for i in range(RECORDS):
        assert time.monotonic() < deadline, f"{i} records in 60 s"
        if conn is None or rng.random() < 0.1:
            if conn is not None:
                conn.close()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.settimeout(30)
            conn.connect(daemon.socket)
        data = record(rng, str(model))
        chosen = [rng.choice(kinds) for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 5]))]
        try:
            socket.send_fds(conn, [data], chosen) if chosen else conn.send(data)
        except OSError:  # over SOCK_SEQPACKET's own size limit
            conn.close()
            conn = None
            continue
        msg, got, _, _ = socket.recv_fds(conn, 70000, 4)
        for fd in got:
            os.close(fd)
        if not msg:  # the daemon closed this connection (a record it cannot read)
            conn.close()
            conn = None
            continue
        reply = json.loads(msg)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            assert isinstance(reply["error"]["code"], str) and isinstance(reply["error"]["message"], str), reply
        answered += 1
        assert daemon.proc.poll() is None, f"record {i}: {data[:200]!r}"
    if conn is not None:
        conn.close()
    assert answered > RECORDS * 0.9
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v", "--store-required")
    assert got == digests(model) and "1 from the store" in r.stderr, r.stderr
    wait_for(lambda: status(pinload_bin, daemon.socket)["clients"] == 1, "every connection closed")
    wait_for(lambda: daemon.fds() <= baseline_fds, f"descriptors back to {baseline_fds}")
    # Connection threads are counted in "clients" above; besides them, at most the process-wide
    # huge-page collapser's worker (src/memory/huge_page_collapse.cc), started on its first use.
    wait_for(lambda: threads_of(daemon.proc.pid) <= baseline_threads + 1, f"threads back to {baseline_threads}")
