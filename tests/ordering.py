"""Ordering in tests without sleeps (test layer): wait for the event itself, bounded.

trio's sequencer and mock clock are the models: a test says *what* must have happened
before it goes on (a thread is blocked in a given function, a condition holds), never
*how long* that usually takes. Every wait has a deadline and fails loudly when it passes,
so a test can neither pass nor fail by timing alone. Stdlib only: scenario processes use
it too.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["eventually", "in_function", "until", "until_async", "until_blocked"]

_POLL_S = 0.001


def eventually(condition: Callable[[], bool], timeout: float = 5.0, every: float = _POLL_S) -> bool:
    """Whether ``condition()`` came true within ``timeout`` (polled every ``every`` s): for
    a test that records the answer as an observation instead of failing on the spot."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Return once ``condition()`` holds; AssertionError if it does not within ``timeout``.

    Polls every millisecond: the conditions here change on other threads (or in other
    processes), which signal nothing the test could wait on.
    """
    if not eventually(condition, timeout):
        raise AssertionError(f"not within {timeout} s: {what or condition}")


async def until_async(condition: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """``until`` for a coroutine: the loop runs while the condition is polled."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or condition}")
        await asyncio.sleep(_POLL_S)


def in_function(thread: int, name: str, where: Callable[[FrameType], bool] | None = None) -> bool:
    """Whether the thread with ident ``thread`` is, right now, inside a function called
    ``name`` (anywhere on its stack) whose frame satisfies ``where``."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code.co_name == name and (where is None or where(frame)):
            return True
        frame = frame.f_back
    return False


def until_blocked(
    thread: int | threading.Thread,
    name: str,
    where: Callable[[FrameType], bool] | None = None,
    timeout: float = 5.0,
) -> None:
    """Return once ``thread`` is inside function ``name`` (see ``in_function``): for a
    function that blocks, the thread has reached the wait. AssertionError at the deadline."""
    ident = thread.ident if isinstance(thread, threading.Thread) else thread
    assert ident is not None, "the thread has not started"
    until(lambda: in_function(ident, name, where), timeout, f"thread {ident} in {name}()")
