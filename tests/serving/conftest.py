"""pytest set-up for the serving tests (rank-aware loading, the vLLM plugin).

Run against a build tree: PYTHONPATH=<build>/python:python python3 -m pytest -q tests/serving
(ctest's python_serving_tests). The vLLM tests need vLLM importable: run them with the venv of
scripts/setup-vllm.sh (ctest does when it exists); elsewhere they skip with the reason.
"""

import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama_ckpt import write_llama  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A ~31 MB Llama-shaped checkpoint in two shards, on the test's disk (ext4 here)."""
    return write_llama(str(tmp_path_factory.mktemp("llama")))
