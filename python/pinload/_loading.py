"""Starting and waiting for loads, with the progress bar: shared by pinload.torch and pinload.numpy.

Imports neither torch nor numpy. The progress bar is tqdm's, with the fields and units of the C++
CLI's bar (src/cli/progress.h) and of the summaries: GB and GB/s (10^9 bytes), e.g.
``pinload  45%|#############                 | 1.23/2.73 GB  2.34 GB/s [00:00<00:01]``.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Union

from . import _core

if TYPE_CHECKING:
    from ._options import _Options

PathLike = Union[str, "os.PathLike[str]", bytes]

#: tqdm's bar_format for a load: the same line as the CLI's progress_line().
BAR_FORMAT = "pinload {percentage:3.0f}%|{bar:30}| {n:.2f}/{total:.2f} GB {rate_noinv_fmt} [{elapsed}<{remaining}]"
#: How the bar draws (tqdm's arguments; tests/python/test_progress.py renders lines with them).
BAR_STYLE = dict(bar_format=BAR_FORMAT, unit=" GB", unit_scale=False, ascii=" #")


def make_bar(total_bytes: int, stream: Any = None, *, delay: float = 1.0, disable: Optional[bool] = None):
    """A tqdm bar counting GB (10^9 bytes) of ``total_bytes``, drawn at most 10 times a second and
    left on screen when closed; ``disable=None``: shown only on a terminal. Advance it with
    ``bar.update(gigabytes)``. Rates are averages over the whole load (smoothing=0), as the CLI's."""
    from tqdm import tqdm

    return tqdm(total=total_bytes / 1e9, smoothing=0, delay=delay, disable=disable, leave=True, mininterval=0.1,
                file=stream if stream is not None else sys.stderr, **BAR_STYLE)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class LoadProgress:
    """Draws a load's progress bar on stderr once it has run for a second (only on a terminal)."""

    def __init__(self, handle: "_core.LoadHandle", progress: bool) -> None:
        self.handle = handle
        self.bar = None
        self.done = 0
        if progress and _stderr_is_terminal():
            total = handle.progress()["bytes_total"]
            self.bar = make_bar(total)
        self.poll = 0.05 if self.bar is not None else 0.2  # short waits: signals get through between them

    def tick(self) -> None:
        if self.bar is None:
            return
        p = self.handle.progress()
        if self.bar.total != p["bytes_total"] / 1e9:  # known once the headers are read
            self.bar.total = p["bytes_total"] / 1e9
        done = p["bytes_done"]
        if done > self.done:
            self.bar.update(done / 1e9 - self.bar.n)
            self.bar.n = done / 1e9  # exact, not a sum of float steps: 100% at the end
            self.done = done

    def finish(self) -> None:
        if self.bar is not None:
            self.tick()
            self.bar.close()


def wait(handle: "_core.LoadHandle", progress: bool) -> "_core.StateDict":
    """Waits for a load (Ctrl-C cancels it) and returns its state dict."""
    shown = LoadProgress(handle, progress)
    try:
        while not handle.wait(shown.poll):
            shown.tick()
    except BaseException:
        handle.cancel()
        handle.wait(None)
        raise
    shown.finish()
    return handle.result()


def as_paths(paths: Union[PathLike, Iterable[PathLike]]) -> List[str]:
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    out = [os.fsdecode(os.fspath(p)) for p in paths]
    if not out:
        raise ValueError("no path given")
    return out


def start(paths: List[str], spec: str, options: "_Options", *, cached_read: str = "auto",
          stream: bool = False, held: Optional["_core.HeldFile"] = None) -> "_core.LoadHandle":
    """Starts the load of ``paths`` to the pinload device ``spec``; ``stream``: HandOut::kStream."""
    return _core.load_async(
        [os.fsencode(p) for p in paths],
        spec,
        **options.load_kwargs(),
        prefetch=options.prefetch,
        cached_read=cached_read,
        stream=stream,
        held=held,
        zero_copy=options.zero_copy,
        **options.convert_kwargs(),
    )
