"""pytest set-up for the remote-source tests: servers started once per session.

SeaweedFS (S3, SigV4 checked) and nginx are started on free loopback ports the
first time a test asks for them and stopped at the end of the session; a
server that cannot start skips its tests with the reason.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO_ROOT / "tests" / "cli"))

import servers  # noqa: E402

BUCKET = "models"
PUBLIC_BUCKET = "public"


def pytest_addoption(parser):
    parser.addoption("--pinload", default=str(REPO_ROOT / "build" / "pinload"), help="the pinload binary")


@pytest.fixture(scope="session")
def pinload_bin(request):
    path = Path(request.config.getoption("--pinload"))
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"pinload binary not found at {path}", pytrace=False)
    return str(path)


def _start(factory):
    try:
        return factory()
    except servers.ServerUnavailable as e:
        pytest.skip(f"server cannot start: {e}")


@pytest.fixture(scope="session")
def weed():
    s = _start(servers.Seaweed)
    client = s.client()
    client.create_bucket(Bucket=BUCKET)
    client.create_bucket(Bucket=PUBLIC_BUCKET)
    yield s
    s.cleanup()


@pytest.fixture(scope="session")
def served_root(tmp_path_factory):
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="session")
def nginx(served_root):
    s = _start(lambda: servers.Nginx(str(served_root)))
    yield s
    s.cleanup()


@pytest.fixture(scope="session")
def tls_nginx(served_root, tmp_path_factory):
    certs = tmp_path_factory.mktemp("certs")
    try:
        cert, key = servers.self_signed_cert(str(certs))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot make a certificate: {e}")
    s = _start(lambda: servers.Nginx(str(served_root), ssl=(cert, key)))
    s.cert = cert
    yield s
    s.cleanup()


@pytest.fixture
def s3_env(weed, monkeypatch):
    """The process environment pointed at the SeaweedFS server."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in weed.env().items():
        monkeypatch.setenv(k, v)
    return weed.env()
