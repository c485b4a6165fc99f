"""Runs safetensors 0.8.0's own Python tests, copied here unmodified (README.md, SHA256SUMS),
against pinload's drop-in: before the test modules import them, the reference's loading entry
points are replaced by pinload's (REPLACED below), so every load they make goes through pinload,
while saving stays the reference's (pinload delegates saving to safetensors). The private
``_safe_open_handle`` (a Python file object instead of a path) is replaced by
pinload.torch.safe_open_handle.

The tests write into the working folder and into ./tests/data: they run in a scratch folder.
Tests that exercise only the reference's writer or its torch helpers are skipped with that reason
(SAVING_ONLY). At the end, every replacement must have been called, and every test that passed
must have called one: a suite that silently went through the reference would fail.
"""

import collections
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402

import pinload  # noqa: E402
import pinload.numpy  # noqa: E402
import pinload.torch  # noqa: E402

SUITE = Path(__file__).resolve().parent
CALLS = collections.Counter()

# (module, name, pinload's replacement). The suite calls all but the two re-exports of safe_open
# (NOT_CALLED_BY_THE_SUITE), which are replaced for completeness.
NOT_CALLED_BY_THE_SUITE = {"safetensors.torch.safe_open", "safetensors.numpy.safe_open"}
REPLACED = [
    (safetensors, "safe_open", pinload.torch.safe_open),
    (safetensors.torch, "safe_open", pinload.torch.safe_open),
    (safetensors.numpy, "safe_open", pinload.torch.safe_open),
    (safetensors.torch, "load_file", pinload.torch.load_file),
    (safetensors.torch, "load", pinload.torch.load),
    (safetensors.torch, "load_model", pinload.torch.load_model),
    (safetensors.numpy, "load_file", pinload.numpy.load_file),
    (safetensors.numpy, "load", pinload.numpy.load),
    (safetensors, "_safe_open_handle", pinload.torch.safe_open_handle),
]

# Tests that call no loading function: the reference's writer, its TensorSpec, or its torch helpers
# for shared tensors (_find_shared_tensors, _is_complete, ...). pinload does not replace those.
SAVING_ONLY = {
    "test_simple.py::test_safetensor_error_module_is_importable",
    "test_simple.py::TestCase::test_serialization",
    "test_simple.py::TestCase::test_serialization_order_invariant",
    "test_simple.py::TestCase::test_serialization_forces_alignment",
    "test_simple.py::TestCase::test_serialization_metadata",
    "test_simple.py::TestCase::test_serialization_no_big_endian",
    "test_simple.py::TestCase::test_pt_sf_save_model_overlapping_storage",
    "test_simple.py::ReadmeTestCase::test_exception",
    "test_pt_comparison.py::TorchTestCase::test_serialization",
    "test_pt_comparison.py::TorchTestCase::test_complex",
    "test_pt_comparison.py::TorchTestCase::test_disjoint_tensors_shared_storage",
    "test_pt_comparison.py::TorchTestCase::test_meta_tensor",
    "test_pt_comparison.py::TorchTestCase::test_sparse",
    "test_pt_comparison.py::TorchTestCase::test_bogus",
    "test_pt_comparison.py::SliceTestCase::test_cannot_serialize_a_non_contiguous_tensor",
    "test_pt_comparison.py::SliceTestCase::test_cannot_serialize_shared",
    "test_pt_model.py::TorchModelTestCase::test_is_complete",
    "test_pt_model.py::TorchModelTestCase::test_find_shared_tensors",
    "test_pt_model.py::TorchModelTestCase::test_find_shared_non_shared_tensors",
    "test_pt_model.py::TorchModelTestCase::test_end_ptr",
    "test_pt_model.py::TorchModelTestCase::test_remove_duplicate_names",
    "test_pt_model.py::TorchModelTestCase::test_failure",
}

# Which tests called at least one replacement (pytest_runtest_call), and which passed.
THROUGH_PINLOAD = set()
PASSED = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = sum(CALLS.values())
    yield
    if sum(CALLS.values()) > before:
        THROUGH_PINLOAD.add(item.nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        PASSED.add(report.nodeid)


def _counting(key, function):
    def replacement(*args, **kwargs):
        CALLS[key] += 1
        return function(*args, **kwargs)

    replacement.__name__ = getattr(function, "__name__", "replacement")
    replacement.__doc__ = getattr(function, "__doc__", None)
    return replacement


def _install():
    for module, name, function in REPLACED:
        key = f"{module.__name__}.{name}"
        if isinstance(function, type):  # safe_open: a class; count its instances
            class Counted(function):
                def __init__(self, *args, _key=key, **kwargs):
                    CALLS[_key] += 1
                    super().__init__(*args, **kwargs)

            Counted.__name__ = Counted.__qualname__ = "safe_open"
            setattr(module, name, Counted)
        else:
            setattr(module, name, _counting(key, function))


_install()  # before pytest imports the test modules (they import these names at import time)


def _check_unmodified():
    for line in (SUITE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        actual = hashlib.sha256((SUITE / name).read_bytes()).hexdigest()
        if actual != digest:
            raise pytest.UsageError(f"{name} differs from safetensors 0.8.0's copy (SHA256SUMS)")


def pytest_configure(config):
    _check_unmodified()
    scratch = Path(tempfile.mkdtemp(prefix="pinload-safetensors-suite-"))
    (scratch / "tests" / "data").mkdir(parents=True)
    config._pinload_scratch = (scratch, os.getcwd())
    os.chdir(scratch)


def pytest_unconfigure(config):
    scratch, previous = getattr(config, "_pinload_scratch", (None, None))
    if scratch is not None:
        os.chdir(previous)
        shutil.rmtree(scratch, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        test_id = item.nodeid.split("safetensors_suite/")[-1]
        if test_id in SAVING_ONLY:
            item.add_marker(pytest.mark.skip(reason="saving only: pinload delegates saving to safetensors"))


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != 0 or session.config.option.collectonly or session.testscollected < 50:
        return  # a failed or partial run says enough
    keys = [f"{m.__name__}.{n}" for m, n, _ in REPLACED]
    unused = [k for k in keys if CALLS[k] == 0 and k not in NOT_CALLED_BY_THE_SUITE]
    print(f"\ncalls of pinload's replacements: {dict(CALLS)}")
    through = PASSED & THROUGH_PINLOAD
    print(f"{len(PASSED)} tests passed; {len(through)} of them called pinload's replacements")
    for nodeid in sorted(PASSED - THROUGH_PINLOAD):
        print(f"  passed without calling pinload: {nodeid.split('safetensors_suite/')[-1]}")
    if PASSED - THROUGH_PINLOAD:  # every test that runs here is a loading test: it must load through pinload
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if unused:
        print(f"pinload's replacements never called: {unused}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
