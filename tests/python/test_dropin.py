"""The safetensors drop-in beyond what safetensors' own suite checks (tests/python/safetensors_suite):
backend=, framework="np", errors catchable as SafetensorError, load(bytes), bytes file names."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import safetensors
import safetensors.numpy
import safetensors.torch as st

import pinload
import pinload.numpy as pnp
import pinload.torch as pt
from pl_helpers import assert_same_dict, in_use


@pytest.fixture
def np_file(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
              "flag": np.asarray(True), "empty": np.zeros((0, 3), np.float16)}
    path = tmp_path / "np.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    return path, arrays


def assert_same_arrays(got, want):
    assert list(got) == list(want) or set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("backend", [None, "mmap", "pread"])
def test_backend_values(small_file, backend):
    path, tensors = small_file
    kwargs = {} if backend is None else {"backend": backend}
    assert_same_dict(pt.load_file(path, **kwargs), tensors)
    with pt.safe_open(path, framework="pt", **kwargs) as f:
        assert_same_dict(f.get_tensors(), tensors)


@pytest.mark.parametrize("bad", ["not_a_backend", "MMAP", "", 1])
def test_unknown_backend_is_an_error(small_file, bad):
    path, _ = small_file
    for call in (lambda: pt.load_file(path, backend=bad), lambda: pt.safe_open(path, framework="pt", backend=bad),
                 lambda: pnp.load_file(path, backend=bad)):
        with pytest.raises(pinload.InvalidFileError, match="backend .* is invalid"):
            call()


def test_numpy_framework_is_zero_copy(np_file):
    path, arrays = np_file
    base = in_use()
    # Into the pool (a file in the page cache is otherwise mapped, whatever earlier tests left there).
    with pt.safe_open(path, framework="np", zero_copy="off") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert_same_arrays(got, arrays)
    assert not got["a"].flags.owndata  # a view of pool memory
    assert in_use() > base
    del got, f
    assert in_use() == base
    assert_same_arrays(pnp.load_file(path), arrays)
    with safetensors.safe_open(str(path), framework="np") as ref, pt.safe_open(path, framework="numpy") as ours:
        for k in ref.keys():
            for index in (..., (slice(None),) * len(arrays[k].shape), ()):
                try:
                    want = ref.get_slice(k)[index]
                except safetensors.SafetensorError as e:  # the reference refuses [...] of a 0-size dim
                    with pytest.raises(safetensors.SafetensorError, match=f"^{re.escape(str(e))}$"):
                        ours.get_slice(k)[index]
                    continue
                np.testing.assert_array_equal(ours.get_slice(k)[index], want)


def test_errors_are_safetensor_errors_and_pinload_errors(small_file, tmp_path):
    path, _ = small_file
    assert issubclass(pinload.Error, safetensors.SafetensorError)
    for cls in (pinload.InvalidFileError, pinload.NotFoundError, pinload.IoError, pinload.OutOfMemoryError):
        assert issubclass(cls, safetensors.SafetensorError) and issubclass(cls, pinload.Error)
    with pt.safe_open(path, framework="pt") as f:
        with pytest.raises(safetensors.SafetensorError, match="^File does not contain tensor nope$") as e:
            f.get_tensor("nope")
        assert isinstance(e.value, pinload.NotFoundError) and e.value.tensor == "nope"
    with pytest.raises(safetensors.SafetensorError, match="^File is closed$") as e:
        f.keys()
    assert isinstance(e.value, pinload.Error) and e.value.file == str(path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(safetensors.SafetensorError):
        pt.load_file(bad)
    with pytest.raises(FileNotFoundError, match="^No such file or directory: "):
        pt.safe_open(tmp_path / "missing.safetensors", framework="pt")


def test_load_bytes_matches_reference(small_file, np_file):
    path, tensors = small_file
    data = path.read_bytes()
    assert_same_dict(pt.load(data), st.load(data))
    np_path, arrays = np_file
    assert_same_arrays(pnp.load(np_path.read_bytes()), arrays)
    with pytest.raises(pinload.InvalidFileError):
        pt.load(data[:20])


def test_bytes_filename(small_file):
    path, tensors = small_file
    assert_same_dict(pt.load_file(os.fsencode(path)), tensors)
    with pt.safe_open(os.fsencode(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
    with pytest.raises(TypeError, match="load\\(data\\)"):
        pt.load_file(path.read_bytes())  # a file's bytes, not a name


def test_load_model_and_save_delegation(tmp_path):
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "m.safetensors"
    pt.save_model(model, str(path))
    assert_same_dict(pt.load_file(path), st.load_file(str(path)))
    other = torch.nn.Linear(4, 3)
    assert pt.load_model(other, path) == ([], [])
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert pt.save({"x": torch.ones(2)}) == st.save({"x": torch.ones(2)})


def test_console_script_runs_the_cli():
    run = subprocess.run([sys.executable, "-m", "pinload", "--version"], capture_output=True, text=True, timeout=60)
    if "not installed next to the Python package" in run.stderr:
        pytest.skip("no pinload program next to this build of the package")
    assert run.returncode == 0, run
    assert run.stdout == f"pinload {pinload.__version__}\n"


def test_wheel_ships_the_console_script():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["pinload"] == "pinload._cli:main"
    assert "install(TARGETS pinload_cli RUNTIME DESTINATION pinload/bin COMPONENT python)" in \
        (root / "CMakeLists.txt").read_text()
