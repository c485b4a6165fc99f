"""The Python progress bar (tqdm) draws the C++ CLI's line: same fields, same units (GB, GB/s).
tests/unit/cli_progress_test.cc checks the CLI's progress_line() against the same strings."""

import io

import pytest

from pinload import _loading

tqdm = pytest.importorskip("tqdm").tqdm

# (bytes done, bytes total, seconds) -> the line both bars draw
LINES = [
    ((1_230_000_000, 2_730_000_000, 0.5),
     "pinload  45%|#############                 | 1.23/2.73 GB  2.46 GB/s [00:00<00:00]"),
    ((0, 2_730_000_000, 3.0), "pinload   0%|                              | 0.00/2.73 GB ? GB/s [00:03<?]"),
    ((2_730_000_000, 2_730_000_000, 70.2),
     "pinload 100%|##############################| 2.73/2.73 GB  0.04 GB/s [01:10<00:00]"),
    ((500_000_000, 10_000_000_000, 4000),
     "pinload   5%|#                             | 0.50/10.00 GB  0.00 GB/s [1:06:40<21:06:40]"),
]


@pytest.mark.parametrize("args,line", LINES)
def test_tqdm_line_is_the_cli_line(args, line):
    done, total, seconds = args
    assert tqdm.format_meter(done / 1e9, total / 1e9, seconds, **_loading.BAR_STYLE) == line


def test_bar_draws_and_stays(tmp_path):
    out = io.StringIO()
    bar = _loading.make_bar(2_000_000_000, out, delay=0, disable=False)
    bar.update(1.0)
    bar.update(1.0)
    bar.close()
    text = out.getvalue()
    assert text.endswith("\n")  # left on screen, as the CLI's
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("pinload 100%|##############################| 2.00/2.00 GB "), last
    assert " GB/s [" in last
