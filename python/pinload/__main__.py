"""``python -m pinload ...``: the pinload command-line program (see pinload._cli)."""

import sys

from ._cli import main

sys.exit(main())
