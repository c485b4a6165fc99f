"""The node store with real processes: a `pinload store serve` daemon and clients (the CLI, Python
subprocesses) that the tests start, kill and restart."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "python"))  # pl_helpers: the memory-cgroup helper


def pytest_addoption(parser):
    parser.addoption("--pinload", required=True, help="path of the pinload program")


@pytest.fixture(scope="session")
def pinload_bin(request) -> str:
    return str(Path(request.config.getoption("--pinload")).resolve())


class Daemon:
    """`pinload store serve` in a subprocess; its stderr goes to `log`."""

    def __init__(self, binary: str, folder: Path, *args: str, prefix: tuple = (), env: dict = None) -> None:
        self.binary, self.folder, self.args, self.prefix = binary, folder, list(args), list(prefix)
        self.env = env
        self.socket = str(folder / "store.sock")
        self.ready = folder / "daemon.ready"
        self.log = folder / "daemon.log"
        self.proc = None

    def start(self) -> "Daemon":
        self.ready.unlink(missing_ok=True)
        cmd = self.prefix + [self.binary, "store", "serve", "--socket", self.socket, "--ready-file", str(self.ready)]
        self.proc = subprocess.Popen(cmd + self.args, stderr=open(self.log, "a"), stdout=subprocess.DEVNULL,
                                     env=self.env)
        deadline = time.monotonic() + 30
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited {self.proc.returncode}: {self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not get ready: " + self.log.read_text())
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@pytest.fixture
def daemon(tmp_path, pinload_bin):
    d = Daemon(pinload_bin, tmp_path, "--budget", "1G").start()
    yield d
    d.stop()
