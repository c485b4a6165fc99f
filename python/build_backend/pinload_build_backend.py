"""pinload's build backend: scikit-build-core's, except that a wheel built on a terminal shows its
progress there.

pip runs a build backend with its output captured and shows none of it unless `pip install -v`
(pypa/pip#6634), so `pip install .` sat for minutes behind a spinner. While this backend builds a
wheel and its output is not a terminal, it copies that output, CMake's and ninja's `[n/N]` lines,
to the terminal the build was started from (/dev/tty) as well; pip still receives all of it (its
log, `-v`, the report of a failed build). Without a controlling terminal (CI, cron, a container
run without -t), or under `pip -v` (which shows the output itself), nothing changes.
PINLOAD_BUILD_TTY=0 turns the copy off.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403  (every hook scikit-build-core has)
from scikit_build_core.build import __all__ as _skbuild_all

__all__ = list(_skbuild_all)
for _name in ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable"):
    if hasattr(_skbuild, _name):
        globals()[_name] = getattr(_skbuild, _name)
        if _name not in __all__:
            __all__.append(_name)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _pip_verbose():
    """Whether the process that runs this backend (pip) was given -v: it then prints the output."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(a == "--verbose" or re.fullmatch(r"-[a-zA-Z]*v[a-zA-Z]*", a) for a in args)


@contextlib.contextmanager
def _copied_to_terminal():
    """Tees file descriptors 1 and 2 (the build's subprocesses inherit them) to /dev/tty."""
    if os.environ.get("PINLOAD_BUILD_TTY") == "0" or os.isatty(1) or _pip_verbose():
        yield
        return
    try:
        tty = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        yield
        return
    saved = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()

    def copy():
        while chunk := os.read(read_end, 65536):
            for fd in (saved[0], tty):  # to pip, as before, and to the terminal
                with contextlib.suppress(OSError):
                    os.write(fd, chunk)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    _flush()
    try:
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        yield
    finally:
        _flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)  # the pipe's last write end is closed: copy() reads to its end
        thread.join()
        for fd in (read_end, tty, *saved):
            os.close(fd)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with _copied_to_terminal():
        return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with _copied_to_terminal():
        return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
