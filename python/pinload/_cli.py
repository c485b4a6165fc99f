"""The ``pinload`` console script (pyproject.toml [project.scripts]): runs the C++ command-line
program shipped in the wheel (``pinload/bin/pinload``), or the one of a build tree
(``<build>/pinload`` next to ``<build>/python/pinload/_core*.so``). ``python -m pinload`` runs it too.
``pinload encoder ...`` is the Python text-encoder server instead (pinload.encoder.server), served
here in this process; the C++ program hands ``encoder`` to ``python -m pinload`` (Note [Encoder
hand-off] in src/cli/encoder_command.cc), so the two never run each other in a loop.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional


def binary() -> Optional[Path]:
    """Where the pinload program is: $PINLOAD_CLI, the wheel's copy, or a build tree's."""
    from . import _core

    if os.environ.get("PINLOAD_CLI"):
        return Path(os.environ["PINLOAD_CLI"])
    core = Path(_core.__file__).resolve()
    for candidate in (core.parent / "bin" / "pinload", core.parents[2] / "pinload"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Replaces this process with the pinload program (its exit code and output are the program's)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "encoder":  # the text-encoder server is Python (docs/encoder.md)
        os.environ.pop("PINLOAD_ENCODER_HANDOFF", None)  # arrived: the server's children start afresh
        from .encoder.server import main as encoder_main

        return encoder_main(args[1:])
    path = binary()
    if path is None:
        sys.stderr.write("pinload: error: the pinload program is not installed next to the Python package\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(path), ["pinload", *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
