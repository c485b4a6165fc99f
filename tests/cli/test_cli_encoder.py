"""``pinload encoder``: the built program hands the command to Python's pinload package
(``python -m pinload encoder``; Note [Encoder hand-off] in src/cli/encoder_command.cc), finding the
package next to the build without PYTHONPATH, and never runs itself in a loop."""

import os
import stat
import subprocess


def run_bare(pinload_bin, *args):
    """The program run without PYTHONPATH (nor the hand-off variables): it finds the package itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PINLOAD_PYTHON", "PINLOAD_ENCODER_HANDOFF")}
    return subprocess.run([pinload_bin, *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)


def test_help_lists_encoder(run_pinload):
    run = run_pinload("--help")
    assert run.returncode == 0, run
    assert any(line.split()[:1] == ["encoder"] for line in run.stdout.splitlines()), run


def test_encoder_help_is_the_python_servers(pinload_bin):
    proc = run_bare(pinload_bin, "encoder", "--help")
    assert proc.returncode == 0, proc
    assert "usage: pinload encoder serve" in proc.stdout and "--model" in proc.stdout, proc
    proc = run_bare(pinload_bin, "encoder", "serve")  # argparse's usage error, passed through
    assert proc.returncode == 2 and "--model" in proc.stderr, proc


def test_a_package_that_hands_encoder_back_is_an_error_not_a_loop(run_pinload, pinload_bin, tmp_path):
    """An interpreter whose pinload runs the program for every command (an older package) would
    hand ``encoder`` back: the second arrival fails at once, saying why."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nshift 3\nexec {pinload_bin} encoder \"$@\"\n")  # drops "-m pinload encoder"
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    run = run_pinload("encoder", "--help", env={"PINLOAD_PYTHON": str(fake)}, timeout=30)
    assert run.returncode == 1 and "came back from Python" in run.stderr and "PINLOAD_PYTHON" in run.stderr, run


def test_a_missing_interpreter_is_named(run_pinload, tmp_path):
    missing = tmp_path / "no-python"
    run = run_pinload("encoder", "serve", env={"PINLOAD_PYTHON": str(missing)})
    assert run.returncode == 1, run
    assert run.stderr.startswith("pinload: error: ") and str(missing) in run.stderr, run
