"""A path with a URL scheme that pinload does not read (gs://, az://, ...) is refused with an
InvalidArgumentError naming it and the schemes pinload reads (docs/remote.md), by the program and
by Python's load_file; it was taken for a local path ("no such file or folder", NotFoundError).
User information and the query (an Azure SAS token) are not shown."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READ = "it reads s3://, http:// and https://"
PATHS = [
    ("gs://b/m.safetensors", "gs://b/m.safetensors"),
    ("az://container/m.safetensors?sv=2024-01-01&sig=SECRET", "az://container/m.safetensors"),
    ("abfs://u:SECRET@acct.dfs.core.windows.net/m", "abfs://acct.dfs.core.windows.net/m"),
]


@pytest.mark.parametrize("path,shown", PATHS, ids=[p.split(":")[0] for p, _ in PATHS])
def test_load_refuses_another_scheme(run_pinload, path, shown):
    r = run_pinload("load", path)
    assert r.returncode == 1, r
    assert f"{shown}: a URL of a scheme pinload does not read: {READ}" in r.stderr, r
    assert "SECRET" not in r.stdout + r.stderr, r
    assert "no such file" not in r.stderr, r


def test_inspect_refuses_another_scheme(run_pinload):
    r = run_pinload("inspect", "gs://b/m.safetensors")
    assert r.returncode == 1 and f"gs://b/m.safetensors: a URL of a scheme pinload does not read: {READ}" in r.stderr, r


def test_a_local_path_is_still_a_path(run_pinload, tmp_path):
    """Only a scheme before '://' is refused: a missing local file is still not found."""
    r = run_pinload("load", tmp_path / "gs:" / "m.safetensors")
    assert r.returncode == 1 and "no such file or folder" in r.stderr, r


def test_python_load_file_raises_invalid_argument(pinload_bin):
    build = Path(pinload_bin).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(build / "python"), str(REPO / "python")])}
    code = """
import pinload, pinload.torch
for path, shown in [("gs://b/m.safetensors", "gs://b/m.safetensors"),
                    ("az://c/m.safetensors?sig=SECRET", "az://c/m.safetensors")]:
    try:
        pinload.torch.load_file(path)
    except pinload.InvalidArgumentError as e:
        assert isinstance(e, ValueError) and e.file == shown, (e, e.file)
        assert "it reads s3://, http:// and https://" in str(e) and "SECRET" not in str(e), e
    else:
        raise AssertionError(path + " was loaded")
print("refused")
"""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stdout + done.stderr
