"""The node store (docs/store.md) with real processes: bytes against an independent reader
(Python's safetensors), single flight counted in the daemon's reads, holds that end with their
process, a killed daemon, a stale socket, other uids, unreadable files, a memory cgroup."""

import hashlib
import json
import os
import pwd
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as st_load, save_file

from conftest import Daemon

CLIENT_ENV = {**os.environ, "PINLOAD_LOG_LEVEL": "warn"}


def write_model(path: Path, mib: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    n = mib * (1 << 20) // 4
    save_file({"w": rng.standard_normal(n, dtype=np.float32), "b": rng.standard_normal(7).astype(np.float16),
               "i": rng.integers(0, 100, 3, dtype=np.int64)}, str(path))
    return path


def digests(path: Path) -> dict:
    """name -> sha256 of each tensor's bytes, read by safetensors (the reference reader)."""
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in st_load(str(path)).items()}


def cli_digests(pinload_bin, socket_path, model, *extra, check=True, env=None):
    r = subprocess.run([pinload_bin, "load", "--store", socket_path, "--digest", "-q", *extra, str(model)],
                       capture_output=True, text=True, env=env or CLIENT_ENV, timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        name, _, _, digest = line.split("\t")
        out[name] = digest
    return out, r


def status(pinload_bin, socket_path) -> dict:
    r = subprocess.run([pinload_bin, "store", "status", "--socket", socket_path, "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


PY_CLIENT = textwrap.dedent("""
    import hashlib, sys, numpy as np, pinload.numpy
    model, sock, required = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    sd = pinload.numpy.load_file(model, store=sock, store_required=required)
    def digests():
        return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in sd.items()}
    print(repr(digests()), flush=True)
    # Hold the tensors until told, then check them again (the daemon may be gone by then).
    for line in sys.stdin:
        print(repr(digests()), flush=True)
""")


def answer(client) -> dict:
    """The client's next report of its digests (its stderr where it has none)."""
    line = client.stdout.readline()
    if not line:
        client.wait(30)
        pytest.fail(f"the client exited {client.returncode}: {client.stderr.read()}")
    return eval(line)


def py_client(model, socket_path, required=False):
    return subprocess.Popen([sys.executable, "-c", PY_CLIENT, str(model), socket_path, "1" if required else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=CLIENT_ENV)


def test_cli_and_python_clients_map_one_copy_with_the_files_bytes(tmp_path, pinload_bin, daemon):
    model = write_model(tmp_path / "m.safetensors", 8, 1)
    expected = digests(model)
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v")
    assert got == expected
    assert "1 from the store" in r.stderr
    client = py_client(model, daemon.socket)
    assert answer(client) == expected
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and s["misses"] == 1 and s["hits"] == 1
    assert s["entries"][0]["path"] == str(model) and s["entries"][0]["holders"] == 1
    client.stdin.close()
    client.wait(30)
    wait_for(lambda: status(pinload_bin, daemon.socket)["entries"][0]["holders"] == 0, "the hold ended")


def test_a_cli_command_and_a_cpp_program_share_one_copy(tmp_path, pinload_bin, daemon):
    """`pinload load` and a C++ program loading through pinload::Session::process() (store_client.cc)
    map the one entry the store read once, with the file's bytes."""
    client_bin = os.environ.get("PINLOAD_STORE_CLIENT")
    if not client_bin:
        pytest.skip("PINLOAD_STORE_CLIENT (the pinload_store_client test program) is set by ctest only")
    model = write_model(tmp_path / "m.safetensors", 8, 2)
    expected = digests(model)
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v")
    assert got == expected and "1 from the store" in r.stderr
    client = subprocess.Popen([client_bin, str(model), daemon.socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=CLIENT_ENV)
    lines = []
    while not lines or not lines[-1].startswith("store "):
        line = client.stdout.readline()
        if not line:
            client.wait(30)
            pytest.fail(f"the C++ client exited {client.returncode}: {client.stderr.read()}")
        lines.append(line.rstrip("\n"))
    assert dict(line.split("\t") for line in lines[:-1]) == expected
    assert lines[-1] == "store 1"
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and s["misses"] == 1 and s["hits"] == 1
    assert s["entries"][0]["path"] == str(model) and s["entries"][0]["holders"] == 1
    client.stdin.close()
    assert client.wait(30) == 0, client.stderr.read()
    wait_for(lambda: status(pinload_bin, daemon.socket)["entries"][0]["holders"] == 0, "the hold ended")


def test_concurrent_cold_clients_cause_one_read(tmp_path, pinload_bin, daemon):
    model = write_model(tmp_path / "m.safetensors", 96, 2)
    expected = digests(model)
    procs = [subprocess.Popen([pinload_bin, "load", "--store", daemon.socket, "--digest", "-q", str(model)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLIENT_ENV)
             for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert {line.split("\t")[0]: line.split("\t")[3] for line in out.splitlines()} == expected
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and s["misses"] + s["hits"] == 4, s


def test_a_killed_client_leaks_nothing_in_the_daemon(tmp_path, pinload_bin, daemon):
    model = write_model(tmp_path / "m.safetensors", 4, 3)
    cli_digests(pinload_bin, daemon.socket, model)  # the entry exists: its memfd is the daemon's
    baseline = daemon.fds()
    clients = [py_client(model, daemon.socket) for _ in range(3)]
    for c in clients:
        assert answer(c) == digests(model)
    assert status(pinload_bin, daemon.socket)["entries"][0]["holders"] == 3
    for c in clients:
        c.send_signal(signal.SIGKILL)
        c.wait(10)
    wait_for(lambda: status(pinload_bin, daemon.socket)["entries"][0]["holders"] == 0, "holds end with the process")
    wait_for(lambda: daemon.fds() <= baseline, f"descriptors back to {baseline}")
    assert status(pinload_bin, daemon.socket)["clients"] == 0


def test_a_killed_daemon_leaves_tensors_valid_and_loads_fall_back_or_fail(tmp_path, pinload_bin):
    model = write_model(tmp_path / "m.safetensors", 4, 4)
    expected = digests(model)
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M").start()
    try:
        client = py_client(model, d.socket)
        assert answer(client) == expected
        d.kill()
        assert os.path.exists(d.socket)  # a crash leaves its socket behind
        client.stdin.write("again\n")
        client.stdin.flush()
        assert answer(client) == expected  # still the same bytes, from the shared pages
        client.stdin.close()
        client.wait(30)
        # Not required: one warning, then the load reads the file itself.
        got, r = cli_digests(pinload_bin, d.socket, model)
        assert got == expected
        assert r.stderr.count("loading without the store") == 1, r.stderr
        # Required: a typed error, exit 1.
        _, r = cli_digests(pinload_bin, d.socket, model, "--store-required", check=False)
        assert r.returncode == 1 and "no store answers" in r.stderr, r.stderr
        required = py_client(model, d.socket, required=True)
        _, err = required.communicate(timeout=60)
        assert required.returncode != 0 and "UnavailableError" in err, err
        # A new daemon replaces the stale socket and serves.
        d.start()
        got, r = cli_digests(pinload_bin, d.socket, model, "-v")
        assert got == expected and "1 from the store" in r.stderr
        assert "stale socket" in d.log.read_text()
    finally:
        d.stop()  # whichever daemon runs, also where an assertion failed


def test_a_second_daemon_on_a_live_socket_is_refused(tmp_path, pinload_bin, daemon):
    r = subprocess.run([pinload_bin, "store", "serve", "--socket", daemon.socket], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "another store" in r.stderr, r.stderr
    assert daemon.proc.poll() is None


@pytest.fixture(scope="module")
def other_user():
    if os.geteuid() != 0:
        pytest.skip("needs root to add a user")
    name = "pinloadstore"
    try:
        pwd.getpwnam(name)
    except KeyError:
        if subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name]).returncode != 0:
            pytest.skip("useradd failed")
    return pwd.getpwnam(name)


def as_user(user, cmd):
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *cmd]


@pytest.fixture
def open_folder():
    """A folder every user can enter (pytest's own is root's alone)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="pinload-store-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_other_uids_are_refused_unless_allowed_and_never_get_a_file_they_cannot_read(open_folder, pinload_bin,
                                                                                     other_user):
    tmp_path = open_folder
    readable = write_model(tmp_path / "open.safetensors", 2, 5)
    secret = write_model(tmp_path / "secret.safetensors", 2, 6)
    os.chmod(readable, 0o644)
    os.chmod(secret, 0o600)  # root's alone
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--socket-mode", "0666").start()
    try:
        # The store holds the secret file (root warmed it).
        assert subprocess.run([pinload_bin, "store", "warm", "--socket", d.socket, str(secret)]).returncode == 0
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "--store-required", "-q",
                                                str(readable)]), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and f"uid {other_user.pw_uid} is not allowed" in r.stderr, r.stderr
        assert status(pinload_bin, d.socket)["refused"] >= 1
    finally:
        d.stop()
    d = Daemon(pinload_bin, tmp_path, "--budget", "256M", "--socket-mode", "0666",
               "--allow-uid", str(other_user.pw_uid)).start()
    try:
        subprocess.run([pinload_bin, "store", "warm", "--socket", d.socket, str(secret)], check=True)
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "--store-required", "-v",
                                                "--digest", str(readable)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "1 from the store" in r.stderr, r.stderr
        assert {l.split("\t")[0]: l.split("\t")[3] for l in r.stdout.splitlines()} == digests(readable)
        # The secret is in the store, but this client cannot open it: refused as without a store.
        r = subprocess.run(as_user(other_user, [pinload_bin, "load", "--store", d.socket, "-q", str(secret)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "ermission denied" in r.stderr, r.stderr
        assert status(pinload_bin, d.socket)["hits"] == 0
    finally:
        d.stop()


def test_a_model_larger_than_the_daemons_cgroup_is_a_typed_error(tmp_path, pinload_bin):
    from pl_helpers import memory_cgroup_v1

    big = write_model(tmp_path / "big.safetensors", 160, 7)
    small = write_model(tmp_path / "small.safetensors", 4, 8)
    cg = memory_cgroup_v1(96 << 20, "pinload-store-test")
    d = Daemon(pinload_bin, tmp_path, "--budget", "1G",
               prefix=("sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh")).start()
    try:
        r = subprocess.run([pinload_bin, "store", "warm", "--socket", d.socket, str(big)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "shared memory" in r.stderr and "cgroup" in r.stderr, r.stderr
        assert d.proc.poll() is None  # not OOM-killed
        got, r = cli_digests(pinload_bin, d.socket, small, "-v")
        assert got == digests(small) and "1 from the store" in r.stderr
    finally:
        d.stop()
        cg.rmdir()


def test_random_records_get_answers_and_the_daemon_goes_on(tmp_path, pinload_bin, daemon):
    rng = random.Random(9)
    model = write_model(tmp_path / "m.safetensors", 1, 10)
    for _ in range(200):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(daemon.socket)
            n = rng.randrange(1, 300)
            junk = bytes(rng.randrange(256) for _ in range(n))
            if rng.random() < 0.3:
                junk = b'{"op": "get", "path": ' + junk + b"}"
            s.sendall(junk)
            reply = json.loads(s.recv(70000))
            assert reply["ok"] is False and "error" in reply
    got, r = cli_digests(pinload_bin, daemon.socket, model, "-v")
    assert got == digests(model) and "1 from the store" in r.stderr
    assert status(pinload_bin, daemon.socket)["errors"] >= 200


ENV_CLIENT = textwrap.dedent("""
    import sys, hashlib, numpy as np, pinload, pinload.torch
    model = sys.argv[1]
    a = pinload.torch.load_file(model)                       # the safetensors drop-in
    b = dict(pinload.iter_tensors([model]))                  # streaming, as the vLLM plugin reads
    digest = lambda sd: {k: hashlib.sha256(v.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
                         for k, v in sd.items()}
    print(repr([digest(a), digest(b)]))
""")


def test_the_pinload_store_variable_routes_every_python_load(tmp_path, pinload_bin, daemon):
    model = write_model(tmp_path / "m.safetensors", 4, 11)
    r = subprocess.run([sys.executable, "-c", ENV_CLIENT, str(model)], capture_output=True, text=True, timeout=120,
                       env={**CLIENT_ENV, "PINLOAD_STORE": daemon.socket})
    assert r.returncode == 0, r.stderr
    a, b = eval(r.stdout)
    assert a == digests(model) and b == digests(model)
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and s["hits"] == 1, s
    # The same figures from Python, for an engine's memory accounting.
    r = subprocess.run([sys.executable, "-c", "import pinload; print(repr(pinload.store_status()))"],
                       capture_output=True, text=True, timeout=60, env={**CLIENT_ENV, "PINLOAD_STORE": daemon.socket})
    assert r.returncode == 0, r.stderr
    py = eval(r.stdout)
    assert py["bytes"] == s["bytes"] > 0 and py["entries"][0]["path"] == str(model) and py["reads"] == 1


CONVERT_CLIENT = textwrap.dedent("""
    import sys, torch, pinload.torch
    from safetensors.torch import load_file
    model, sock = sys.argv[1], sys.argv[2]
    got = pinload.torch.load_file(model, dtype=torch.bfloat16, keep=["bias"], store=sock, store_required=True)
    # torch's own conversion of the file safetensors reads: floating tensors to bf16 but the kept ones.
    want = {k: (v.to(torch.bfloat16) if v.is_floating_point() and "bias" not in k else v)
            for k, v in load_file(model).items()}
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    print("ok")
""")


def test_a_converting_load_maps_the_stores_converted_entry(tmp_path, pinload_bin, daemon):
    """Note [Converted store entries]: `store warm --dtype` converts once in the daemon; CLI and
    Python loads with that dtype map it, bytes equal to torch's conversion; a plain load is an entry of its own."""
    model = tmp_path / "m.safetensors"
    rng = np.random.default_rng(12)
    save_file({"blocks.0.weight": rng.standard_normal((256, 96), dtype=np.float32),
               "blocks.0.bias": rng.standard_normal(96).astype(np.float16),
               "ids": rng.integers(0, 9, 5, dtype=np.int64)}, str(model), metadata={"format": "pt"})
    r = subprocess.run([pinload_bin, "store", "warm", "--socket", daemon.socket, "--dtype", "bf16", "--keep", "bias",
                        str(model)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and [e["dtype"] for e in s["entries"]] == ['BF16 keep=["bias"]'], s
    r = subprocess.run([sys.executable, "-c", CONVERT_CLIENT, str(model), daemon.socket], capture_output=True,
                       text=True, timeout=120, env=CLIENT_ENV)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    got, r = cli_digests(pinload_bin, daemon.socket, model, "--dtype", "bf16", "--keep", "bias", "-v")
    assert "1 from the store" in r.stderr
    s = status(pinload_bin, daemon.socket)
    assert s["reads"] == 1 and s["hits"] == 2, s
    assert "(as BF16 keep=" in subprocess.run([pinload_bin, "store", "status", "--socket", daemon.socket],
                                              capture_output=True, text=True, timeout=30).stdout
    # The same file as stored: another entry, the file's own bytes.
    got, _ = cli_digests(pinload_bin, daemon.socket, model)
    assert got == digests(model)
    assert sorted(e["dtype"] for e in status(pinload_bin, daemon.socket)["entries"]) == ["", 'BF16 keep=["bias"]']
