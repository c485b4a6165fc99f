"""pytest set-up for the pinload Python package tests.

Run against a build tree without installing:
    PYTHONPATH=<build>/python:python python3 -m pytest -q tests/python
(ctest's python_package_tests does exactly that), or against an installed wheel.
"""

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


@pytest.fixture
def small_file(tmp_path):
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "small.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors
