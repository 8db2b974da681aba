"""A one-line progress bar on stderr (no dependency), silent when stderr is not a terminal.

Part of ``asyncrpc.bench``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts steps towards ``total`` and redraws one line on each step."""

    def __init__(
        self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 28
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total = max(1, total)
        self.done = 0
        self.width = width
        self._start = time.monotonic()
        self._label = ""

    def step(self, label: str) -> None:
        """Start the step called ``label`` (the previous one is counted as done)."""
        if self._label:
            self.done = min(self.total, self.done + 1)
        self._label = label
        self._draw()

    def note(self, text: str) -> None:
        """Print a line above the bar (an error or a notice)."""
        if self.enabled:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text.rstrip() + "\n")
        self._draw()

    def close(self) -> None:
        if self._label:
            self.done = self.total
            self._draw()
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = int(time.monotonic() - self._start)
        line = f"[{bar}] {self.done}/{self.total} {elapsed // 60}:{elapsed % 60:02d} {self._label}"
        self.stream.write("\r\x1b[2K" + line[:120])
        self.stream.flush()
