"""Work other threads hand to the event loop, one wake-up per batch (runtime layer).

A thread that starts many calls in a row (a window of ``rpc_async``, or the callback pool
running a batch of done-callbacks that each start the next call) would otherwise wake the
loop once per call: one handle, one lock and one eventfd write each, and on the loop one
callback each. Here the first item of a batch schedules one drain; the items that arrive
before the loop runs it ride along, in the order they were handed over.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from asyncrpc.runtime import handoffs

__all__ = ["LoopInbox"]


class LoopInbox:
    """Runs ``fn(*args)`` handed over from any thread on ``loop``, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._scheduled = False  # a drain is on the loop's ready queue (or running)

    def put(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Queue ``fn(*args)`` for the loop (from a thread other than the loop's).

        Raises:
            RuntimeError: the loop is closed (as ``call_soon_threadsafe`` raises it).
        """
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled:
                return  # the drain already on its way takes this one too
            self._scheduled = True
        handoffs.count("thread_to_loop")
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._items.clear()
                self._scheduled = False
            raise

    def _drain(self) -> None:
        # One pass over what was queued when it starts; what threads queue meanwhile
        # schedules the next drain (the flag is cleared with the batch taken).
        with self._lock:
            batch, self._items = self._items, []
            self._scheduled = False
        for fn, args in batch:
            try:
                fn(*args)
            except Exception as exc:  # as the loop reports a failing callback; go on
                self._loop.call_exception_handler(
                    {"message": f"exception in {fn!r}, handed to the loop", "exception": exc}
                )
