"""Closing what a stream no longer reads: generators and stream arguments, on the thread
where their ``finally`` may run (layer L2.42).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrpc.runtime.ports import Loop

__all__ = ["close_iterable", "close_now"]

_log = logging.getLogger(__name__)


def close_now(source: Any) -> None:
    """Close a plain generator (runs its ``finally``); on the thread that may block."""
    close = getattr(source, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:
        _log.exception("closing a streamed generator failed")


def close_iterable(loop: Loop, items: Any) -> None:
    """Close an iterable nobody will read (on the loop): an async one's ``aclose`` in a
    task of the loop, a plain one's ``close`` on the pool (its ``finally`` may block)."""
    if hasattr(items, "aclose"):
        task = loop.aio.create_task(_aclose(items))
        task.add_done_callback(_log_failure)
    elif hasattr(items, "close"):
        try:
            loop.pool.submit(close_now, items)
        except Exception:  # the pool is shut down: its finally runs when it is collected
            _log.debug("could not close an unread stream argument on the pool")


async def _aclose(items: Any) -> None:
    await items.aclose()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("closing an unread stream argument failed", exc_info=task.exception())
