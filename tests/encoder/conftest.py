"""The encoder server's tests: tiny models built here (tiny_models.py), servers run as real
processes on loopback ports the tests pick."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m pinload encoder serve`` in a subprocess; its stderr goes to ``log``."""

    def __init__(self, tmp: Path, *args: str, port: int = 0) -> None:
        self.args = list(args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        self.proc = None

    def start(self) -> "Server":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pinload", "encoder", "serve", *self.args,
                                          "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1"],
                                         stdout=log, stderr=log, env=env)
        return self

    def wait_ready(self, timeout: float = 180) -> "Server":
        import urllib3

        deadline = time.monotonic() + timeout
        http = urllib3.PoolManager()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if http.request("GET", self.url + "/readyz", retries=False, timeout=2).status == 200:
                    return self
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log.read_text()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    t5, other = tiny_models.make_t5(root / "t5"), tiny_models.make_t5(root / "t5_other", seed=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the same tokenizer: only the weights differ
        (other / f).write_bytes((t5 / f).read_bytes())
    return {"t5": t5, "t5_other": other,
            "clip": tiny_models.make_clip(root / "clip"),
            "clip_proj": tiny_models.make_clip(root / "clip_proj", projection=True),
            "flux": tiny_models.make_flux(root / "flux")}


@pytest.fixture(scope="session")
def servers(models, tmp_path_factory):
    """Two servers started at once (their start-up, mostly imports, overlaps): "main" serves the tiny
    FLUX pipeline's T5 with defaults; "small" has a 4-prompt queue and no batching, for the overload
    and restart tests."""
    tmp = tmp_path_factory.mktemp("servers")
    main = Server(tmp, "--model", str(models["flux"]), "--max-prompts", "8", "--max-prompt-chars", "200").start()
    small = Server(tmp, "--model", str(models["t5"]), "--max-queue", "4", "--max-prompts", "4", "--max-batch", "1",
                   "--batch-window", "0").start()
    try:
        main.wait_ready()
        small.wait_ready()
        yield {"main": main, "small": small}
    finally:
        main.stop()
        small.stop()
