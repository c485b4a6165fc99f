"""Reliability under hostile input and limits, through the Python package: one version of each
file per load, safe_open holding its file, special files, typed errors for what torch cannot hold,
F4 as the reference loads it, descriptors under a low RLIMIT_NOFILE, the pool budget."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import safetensors.torch as st
from safetensors import safe_open as reference_safe_open

import pinload
import pinload.torch as pt
from pl_helpers import assert_same, assert_same_dict, write_raw, write_sharded

REPO = Path(__file__).resolve().parents[2]


def two_versions(tmp_path: Path):
    """Two files of one size whose tensor differs in dtype, shape and bytes: a mix would show."""
    a = write_raw(tmp_path / "a.safetensors", [("w", "F32", [4, 4], bytes(range(64)))], pad_to=64)
    b = write_raw(tmp_path / "b.safetensors", [("w", "F16", [8, 4], bytes(range(64, 128)))], pad_to=64)
    assert a.stat().st_size == b.stat().st_size
    return a, b, st.load_file(str(a))["w"], st.load_file(str(b))["w"]


class Renamer:
    """Swaps `path` between two files (hard links renamed over it) until stopped, a swap every
    `period` seconds. Each swap also changes both files' ctime (their link counts change), which
    a load counts as a change of its file (include/pinload/file_identity.h): swapped back to back, no load
    finishes between two swaps; a short pause lets some through, while most still overlap one."""

    def __init__(self, path: Path, a: Path, b: Path, period: float = 0.0005):
        self.path, self.a, self.b, self.period = path, a, b, period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        tmp = self.path.with_suffix(".tmp")
        i = 0
        while not self.stop.is_set():
            if tmp.exists():
                tmp.unlink()
            os.link(self.a if i % 2 else self.b, tmp)
            os.replace(tmp, self.path)
            i += 1
            time.sleep(self.period)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_racing_renamer_1000_loads_never_mix(tmp_path):
    """Item 1: every load returns one version whole, or raises pinload.Error; none mixes them."""
    a, b, want_a, want_b = two_versions(tmp_path)
    path = tmp_path / "m.safetensors"
    os.link(a, path)
    whole = refused = 0
    with Renamer(path, a, b):
        for _ in range(1000):
            try:
                got = pt.load_file(path, threads=2)["w"]
            except pinload.IoError:
                refused += 1
                continue
            want = want_a if got.dtype == torch.float32 else want_b
            assert_same(got, want, "w")  # the old code returned the old header's view of the new bytes
            whole += 1
    assert whole > 0, refused


def test_safe_open_holds_its_file(tmp_path):
    """Item 1: a path replaced after safe_open does not change what get_tensor returns."""
    a, b, want_a, _ = two_versions(tmp_path)
    path = tmp_path / "m.safetensors"
    os.link(a, path)
    with pinload.safe_open(path) as f, reference_safe_open(str(path), framework="pt") as ref:
        os.replace(b, path)
        assert f.get_shape("w") == [4, 4]
        got = f.get_tensor("w")
        assert_same(got, want_a, "w")
        assert_same(got, ref.get_tensor("w"), "w")


def run_python(code: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def within_seconds(seconds, fn, fifo):
    """fn() in a thread; fails if it has not returned after `seconds` (then unblocks it by opening the
    FIFO for writing, so that the thread ends)."""
    result = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("blocked on the FIFO")
    return result.get("error")


@pytest.mark.parametrize("call", ["load_file", "load_files", "safe_open", "index", "iter_tensors"])
def test_fifo_is_refused_without_blocking(tmp_path, call):
    """Item 4: open() of a FIFO blocked forever (and ignored SIGINT); now InvalidFileError at once."""
    fifo = tmp_path / "model-00001-of-00001.safetensors"
    os.mkfifo(fifo)
    target = fifo
    if call == "index":
        target = tmp_path / "model.safetensors.index.json"
        target.write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    fn = {"load_file": lambda: pt.load_file(target), "load_files": lambda: pt.load_files([target]),
          "safe_open": lambda: pinload.safe_open(target), "index": lambda: pt.load_files(target),
          "iter_tensors": lambda: list(pt.iter_tensors(target))}[call]
    error = within_seconds(20, fn, fifo)
    assert isinstance(error, pinload.InvalidFileError) and "FIFO" in str(error), repr(error)


def test_socket_and_device_are_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    try:
        with pytest.raises(pinload.InvalidFileError, match="socket"):
            pt.load_file(path)
    finally:
        server.close()
    with pytest.raises(pinload.InvalidFileError, match="character device"):
        pt.load_file("/dev/zero")


def test_symlink_loop_is_typed(tmp_path):
    """Item 5: ELOOP on the path was NotFoundError, a loop inside a folder a bare RuntimeError."""
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    with pytest.raises(pinload.IoError) as info:
        pt.load_file(loop)
    assert not isinstance(info.value, pinload.NotFoundError)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "x.safetensors").symlink_to(folder / "x.safetensors")
    with pytest.raises(pinload.Error):
        pt.load_files(folder)


@pytest.mark.parametrize("shape", [[1 << 63, 0], [0, (1 << 64) - 1], [1] * 65])
def test_shapes_torch_cannot_hold_are_invalid_file_errors(tmp_path, shape):
    """Item 5: valid files torch cannot represent raised TypeError/ValueError with no file or tensor."""
    path = write_raw(tmp_path / "odd.safetensors", [("odd", "U8", shape, b"\x07" if 0 not in shape else b"")])
    for call in (lambda: pt.load_file(path), lambda: pinload.safe_open(path).get_tensor("odd"),
                 lambda: list(pt.iter_tensors(path))):
        with pytest.raises(pinload.InvalidFileError) as info:
            call()
        assert info.value.tensor == "odd" and info.value.file == str(path)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2")
def test_f4_loads_as_the_reference_does(tmp_path):
    """Item 7: F4 [4, 6] is torch.float4_e2m1fn_x2 [4, 3]; an odd last dimension is refused, as there."""
    data = bytes(range(12))
    path = write_raw(tmp_path / "f4.safetensors", [("q", "F4", [4, 6], data), ("e", "F4", [2, 0], b"")])
    want = st.load_file(str(path))
    assert want["q"].dtype == torch.float4_e2m1fn_x2 and list(want["q"].shape) == [4, 3]
    assert_same_dict(pt.load_file(path), want)
    with pinload.safe_open(path) as f:
        assert_same(f.get_tensor("q"), want["q"], "q")
    odd = write_raw(tmp_path / "odd.safetensors", [("q", "F4", [2, 3], b"\x11" * 3)])
    with pytest.raises(Exception):
        st.load_file(str(odd))
    with pytest.raises(pinload.InvalidFileError, match="last dimension must be even") as info:
        pt.load_file(odd)
    assert info.value.tensor == "q"


def test_forty_shards_under_ulimit_16(tmp_path):
    """Item 6: every shard held open for the whole load failed a 40-shard checkpoint under ulimit -n 16
    (and 60); the reference, shard by shard, works at 16. In a child process without torch (whose
    import alone takes long on a busy machine); the bytes of sharded loads are checked elsewhere."""
    gen = torch.Generator().manual_seed(6)
    tensors = {f"layer.{i}.weight": torch.randn(64, 33, generator=gen) for i in range(80)}
    index = write_sharded(tmp_path / "model", tensors, shards=40)
    proc = run_python(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        import pinload
        sd = pinload._core.load_async([{str(index).encode()!r}], threads=8, files_in_flight=2).result()
        print("ok", len(sd), sd.total_bytes)
    """, timeout=300)
    assert proc.returncode == 0 and "ok 80" in proc.stdout, proc.stderr[-3000:]


def test_pool_bytes_budget_fails_before_reading(tmp_path, small_file):
    """Item 2: the pool budget is settable from Python; a load that cannot fit it fails at once."""
    path, tensors = small_file
    with pytest.raises(pinload.OutOfMemoryError) as info:
        pt.load_file(path, pool_bytes=1)
    assert info.value.file == str(path) and "pool budget is 1 bytes" in str(info.value)
    assert_same_dict(pt.load_file(path, pool_bytes="64M"), tensors)
    with pytest.raises(ValueError):
        pt.load_file(path, pool_bytes=0)


def test_a_converting_load_fails_typed_in_a_memory_cgroup_smaller_than_it_needs(tmp_path):
    """load_file(dtype=torch.bfloat16) under a memory cgroup smaller than the converted output was
    OOM-killed; now it raises pinload.OutOfMemoryError naming the file (Note [Memory limits])."""
    from pl_helpers import memory_cgroup_v1

    cg = memory_cgroup_v1(384 << 20)
    big = tmp_path / "big.safetensors"
    st.save_file({f"w{i}": torch.ones(20 << 20) for i in range(10)}, str(big))  # 800 MiB of fp32: 400 MiB as bf16
    code = textwrap.dedent(f"""
        import sys, torch
        import pinload, pinload.torch as pt
        try:
            pt.load_file({str(big)!r}, dtype=torch.bfloat16)
        except pinload.OutOfMemoryError as e:
            print("typed:", e)
            sys.exit(3)
        print("loaded")
        """)
    try:
        # In the cgroup before torch is imported: its memory is charged there too.
        r = subprocess.run(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$0" -c "$1"', sys.executable, code],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)  # -9 before: OOM-killed
        assert str(big) in r.stdout and "memory limit" in r.stdout, r.stdout
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass
