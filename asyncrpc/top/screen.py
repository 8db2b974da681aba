"""The live view: draw a frame every interval with curses until ``q`` (layer L4).

curses is in the standard library and a table that redraws once a second needs little
of a TUI library, so there is no dependency to install. Scrapes run on the pool of
``Scraper``; this loop only waits for keys between frames, so ``q`` answers at once.
"""

from __future__ import annotations

import contextlib
import curses
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.top.render import Line

__all__ = ["run"]


def _draw(window: Any, lines: Sequence[Line]) -> None:
    height, width = window.getmaxyx()
    window.erase()
    for y, line in enumerate(lines[:height]):
        # addnstr on the last cell of the screen raises: keep one column free.
        attr = curses.A_REVERSE | curses.A_BOLD if line.alert else curses.A_NORMAL
        with contextlib.suppress(curses.error):
            window.addnstr(y, 0, line.text, max(0, width - 1), attr)
    window.refresh()


def _loop(window: Any, next_frame: Callable[[], Sequence[Line]], interval: float) -> None:
    curses.curs_set(0)
    window.nodelay(False)
    while True:
        started = time.monotonic()
        _draw(window, next_frame())
        # Wait out the rest of the interval for a key, in short slices so a resize or
        # a `q` is seen at once.
        while (left := interval - (time.monotonic() - started)) > 0:
            window.timeout(max(1, int(min(left, 0.2) * 1000)))
            key = window.getch()
            if key in (ord("q"), ord("Q"), 27):
                return
            if key == curses.KEY_RESIZE:
                break


def run(next_frame: Callable[[], Sequence[Line]], interval: float) -> None:
    """Show ``next_frame()`` every ``interval`` seconds until the user presses q.

    Args:
        next_frame: scrapes and returns the lines of a frame.
        interval: seconds between the starts of two frames.
    """
    curses.wrapper(_loop, next_frame, interval)
