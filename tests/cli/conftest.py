"""pytest set-up for the CLI tests: the --pinload option and a runner."""

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    parser.addoption(
        "--pinload",
        default=str(REPO_ROOT / "build" / "pinload"),
        help="the pinload binary to test (default: build/pinload under the repository root)",
    )


@pytest.fixture(scope="session")
def pinload_bin(request):
    path = Path(request.config.getoption("--pinload"))
    if not path.is_absolute():
        path = (REPO_ROOT / path) if not path.exists() else path.resolve()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"pinload binary not found at {path}; build it or pass --pinload PATH", pytrace=False)
    return str(path)


class Run:
    """One finished pinload invocation."""

    def __init__(self, args, proc):
        self.args = args
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    def __repr__(self):
        return (f"pinload {' '.join(self.args)} -> {self.returncode}\n"
                f"stdout: {self.stdout[:2000]}\nstderr: {self.stderr}")


@pytest.fixture(scope="session")
def run_pinload(pinload_bin):
    """run_pinload(*args, env=None) -> Run. Never raises on a non-zero exit."""

    def run(*args, timeout=60, env=None):
        """env: variables to set on top of this process's environment."""
        args = [str(a) for a in args]
        proc = subprocess.run(
            [pinload_bin, *args],
            env=None if env is None else {**os.environ, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="surrogateescape",
            timeout=timeout,
        )
        return Run(args, proc)

    return run
