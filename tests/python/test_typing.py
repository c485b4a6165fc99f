"""Type checkers see pinload's public API with its signatures, not as Any (the lazy names of
pinload/__init__.py are visible under TYPE_CHECKING). Runs mypy when it is installed."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE_SOURCE = Path(__file__).resolve().parents[2] / "python"

# name -> a piece of the type mypy must reveal for pinload.<name>
EXPECTED = {
    "load_files": "def (index_or_paths:",
    "load_files_batch": "def (paths:",
    "iter_tensors": "-> typing.Iterator[tuple[str,",
    "load_file": "def (filename:",
    "safe_open": "-> pinload.torch.safe_open",
    "ModelCache": "-> pinload.cache.ModelCache",
    "patch_diffusers": "def (",
    "pool_stats": "def (device:",
    "torch.load_model": "def (model:",
    "numpy.load_file": "-> dict[str, numpy.ndarray",
}


def test_public_api_is_typed(tmp_path):
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text("import pinload\nimport pinload.torch\nimport pinload.numpy\n" +
                       "".join(f"reveal_type(pinload.{name})\n" for name in EXPECTED))
    # Third-party packages are not checked (torch alone takes minutes): they count as Any.
    config = tmp_path / "mypy.ini"
    config.write_text(textwrap.dedent("""\
        [mypy]
        ignore_missing_imports = True
        [mypy-torch.*,numpy.*,diffusers.*,transformers.*,accelerate.*,safetensors.*,tqdm.*,ml_dtypes.*]
        follow_imports = skip
        """))
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                          str(tmp_path / "cache"), "--no-error-summary", str(snippet)],
                         env={**os.environ, "MYPYPATH": str(PACKAGE_SOURCE)}, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    revealed = [line.split("Revealed type is ", 1)[1] for line in run.stdout.splitlines() if "Revealed type is" in line]
    assert len(revealed) == len(EXPECTED), run.stdout + run.stderr
    for (name, piece), text in zip(EXPECTED.items(), revealed):
        assert text.strip('"') != "Any", (name, text)
        assert piece in text, (name, text)
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert not errors, "\n".join(errors)
