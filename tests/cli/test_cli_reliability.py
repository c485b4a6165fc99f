"""CLI reliability: hostile names and metadata are escaped
(Note [Printable text] in src/cli/command.h) and `inspect --json` stays exact; special files are
refused at once; --pool-bytes; a memory cgroup smaller than the model is an error, not a SIGKILL."""

import json
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

import stfiles

HOSTILE_NAMES = [
    "ok.weight",
    "forged\tF32\t[1]\t4 B\t[0, 4)\n  evil.weight",  # would print a whole fake line
    "\x1b]0;window title\x07title",  # OSC: sets the terminal's title
    "\x1b[2J\x1b[Hclear",  # clears the screen
    "back\\x41slash",  # an escaped-looking name must stay distinguishable
    "c1\u009bcontrol",
    "w\u00fcrfel",  # printable UTF-8 is kept
]
HOSTILE_METADATA = {"k\n": "v\r\nforged line", "title": "\x1b]0;x\x07", "plain": "w\u00fcrfel"}


@pytest.fixture
def hostile(tmp_path):
    tensors = [(name, "U8", [2], bytes([i, i + 1])) for i, name in enumerate(HOSTILE_NAMES)]
    path = tmp_path / "hostile.safetensors"
    stfiles.write_raw(path, tensors, metadata=HOSTILE_METADATA)
    return path


def assert_no_control_bytes(text):
    for line in text.split("\n"):
        bad = [c for c in line if (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F]
        assert not bad, repr(line)


def test_inspect_escapes_names_and_metadata(hostile, run_pinload):
    run = run_pinload("inspect", hostile)
    assert run.returncode == 0, run
    assert_no_control_bytes(run.stdout)
    lines = run.stdout.splitlines()
    # A header line, one per tensor, one per metadata entry, the total.
    assert len(lines) == 1 + len(HOSTILE_NAMES) + len(HOSTILE_METADATA) + 1, run.stdout
    names = {line[2:].split("\t")[0] for line in lines[1:] if line.startswith("  ") and "\t" in line}
    assert names == {stfiles.printable(n) for n in HOSTILE_NAMES}
    for key, value in HOSTILE_METADATA.items():
        assert f"  metadata {stfiles.printable(key)} = {stfiles.printable(value)}" in lines
    assert "w\u00fcrfel" in run.stdout


def test_inspect_json_is_exact(hostile, run_pinload):
    run = run_pinload("inspect", "--json", hostile)
    assert run.returncode == 0, run
    out = json.loads(run.stdout)["files"][0]
    assert sorted(t["name"] for t in out["tensors"]) == sorted(HOSTILE_NAMES)
    assert out["metadata"] == HOSTILE_METADATA


def test_load_digest_escapes_names(hostile, run_pinload):
    run = run_pinload("load", "--digest", hostile)
    assert run.returncode == 0, run
    assert_no_control_bytes(run.stdout)
    assert run.stdout.splitlines() == stfiles.expected_digest(hostile)
    assert len(run.stdout.splitlines()) == len(HOSTILE_NAMES)


def test_fifo_socket_and_device_are_one_error_line(tmp_path, run_pinload):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.safetensors"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    try:
        for path, kind in ((fifo, "FIFO"), (sock_path, "socket"), (Path("/dev/zero"), "character device")):
            for command in ("inspect", "load"):
                run = run_pinload(command, path, timeout=20)  # the old open() never returned on a FIFO
                assert run.returncode == 1, run
                assert run.stderr.startswith(f"pinload: error: {path}: is a {kind}"), run
    finally:
        server.close()


def test_pool_bytes(tmp_path, run_pinload):
    path = tmp_path / "m.safetensors"
    stfiles.write_raw(path, [("w", "U8", [100_000], bytes(100_000))])
    run = run_pinload("load", "--pool-bytes", "64K", path)
    assert run.returncode == 1 and "pool budget is 65536 bytes" in run.stderr, run
    assert run_pinload("load", "--pool-bytes", "4M", path).returncode == 0  # a 2 MiB huge-page granule fits
    assert run_pinload("load", "--pool-bytes", "0", path).returncode == 2


def memory_cgroup_v1():
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    cg = root / f"pinload-test-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup: {e}")
    return cg


def test_memory_cgroup_smaller_than_the_model_is_an_error(tmp_path, pinload_bin):
    """Item 2: under a memory limit smaller than the model the CLI was SIGKILLed with no error."""
    cg = memory_cgroup_v1()
    limit = 96 << 20
    big = tmp_path / "big.safetensors"
    stfiles.write_raw(big, [(f"w{i}", "U8", [16 << 20], os.urandom(16 << 20)) for i in range(10)])  # 160 MiB
    small = tmp_path / "small.safetensors"
    stfiles.write_raw(small, [("w", "U8", [8 << 20], os.urandom(8 << 20))])
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        memsw = cg / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit))  # no swapping past the limit either

        def run_in_cgroup(path):
            return subprocess.run(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$0" load "$1"',
                                   pinload_bin, str(path)], capture_output=True, text=True, timeout=120)

        run = run_in_cgroup(big)
        assert run.returncode == 1, (run.returncode, run.stderr)  # -9 before: OOM-killed
        assert run.stderr.startswith(f"pinload: error: {big}: checkpoint needs"), run.stderr
        assert "memory limit" in run.stderr and "cgroup v1" in run.stderr, run.stderr
        run = run_in_cgroup(small)
        assert run.returncode == 0, (run.returncode, run.stderr)
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass


@pytest.mark.parametrize("extra", [["--dtype", "bf16"], ["--dtype", "fp16"], ["--device", "sim"],
                                   ["--device", "sim", "--dtype", "bf16"]],
                         ids=["bf16", "fp16", "sim", "sim-bf16"])
def test_every_load_kind_fails_typed_in_a_memory_cgroup_smaller_than_it_needs(tmp_path, pinload_bin, extra):
    """Conversions and stand-in device loads ignored the memory limit and were OOM-killed (137)
    where a plain load failed with a typed error (Note [Memory limits] in memory_limit.h)."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    cg = memory_cgroup_v1()
    limit = 96 << 20
    big = tmp_path / "big.safetensors"
    save_file({f"w{i}": np.ones((4 << 20,), dtype=np.float32) for i in range(10)}, str(big))  # 160 MiB fp32
    small = tmp_path / "small.safetensors"
    save_file({"w": np.ones((1 << 20,), dtype=np.float32)}, str(small))  # 4 MiB
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        memsw = cg / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit))

        def run_in_cgroup(path):
            return subprocess.run(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$0" load --digest "$@"',
                                   pinload_bin, *extra, str(path)], capture_output=True, text=True, timeout=120)

        run = run_in_cgroup(big)
        assert run.returncode == 1, (run.returncode, run.stderr)  # -9 before: OOM-killed
        assert run.stderr.startswith(f"pinload: error: {big}: "), run.stderr
        assert "memory limit" in run.stderr and "cgroup v1" in run.stderr, run.stderr
        assert run.stdout == ""  # nothing partial
        run = run_in_cgroup(small)
        assert run.returncode == 0, (run.returncode, run.stderr)
        assert len(run.stdout.splitlines()) == 1
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass
