"""Work other threads hand to the event loop, one wake-up per batch (layer L2.01).

A thread that starts many calls in a row (a window of ``rpc_async``, or the callback pool
running a batch of done-callbacks that each start the next call), or a pool thread that
finishes job after job, would otherwise wake the loop once per item: one handle, one lock
and one eventfd write each, and on the loop one callback each. Here the first item of a
batch schedules one drain; the items that arrive before the loop runs it ride along, in
the order they were handed over. The agent's outbox hands calls over this way, and the
worker pool its completions.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from asyncrpc.runtime.threads import handoffs

__all__ = ["LoopInbox"]


class LoopInbox:
    """Runs ``fn(*args)`` handed over from any thread on ``loop``, in order.

    Args:
        loop: the loop that runs the items.
        kind: the hand-off each wake-up counts as (``asyncrpc.runtime.threads.handoffs.KINDS``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: str) -> None:
        self._loop = loop
        self._kind = kind
        # No lock: a deque's append and popleft are atomic, and the flag is read after the
        # append and cleared before the drain counts what it takes (see _drain).
        self._items: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._scheduled = False  # a drain is on the loop's ready queue

    def put(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Queue ``fn(*args)`` for the loop (from a thread other than the loop's).

        Raises:
            RuntimeError: the loop is closed (as ``call_soon_threadsafe`` raises it); what
                was queued is dropped with it.
        """
        self._items.append((fn, args))
        if self._scheduled:
            return  # the drain already on its way takes this one too
        self._scheduled = True
        handoffs.count(self._kind)
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            self._items.clear()
            self._scheduled = False
            raise

    def _drain(self) -> None:
        # Clear the flag before draining: an item appended after this point either is
        # drained below or sees the flag clear and schedules another drain.
        self._scheduled = False
        items = self._items
        try:
            for _ in range(len(items)):  # later items wait for the next drain
                fn, args = items.popleft()
                try:
                    fn(*args)
                except Exception as exc:  # one failing item must not strand the rest
                    self._loop.call_exception_handler(
                        {"message": f"asyncrpc: {fn!r} failed on the loop", "exception": exc}
                    )
        finally:  # a KeyboardInterrupt mid-way: what is left gets another drain
            if items and not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._drain)
