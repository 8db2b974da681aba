"""An event loop (uvloop when installed) running in a background thread (layer L2.01).

Plain synchronous programs get their agent on such a loop: ``init_rpc`` starts it, the
caller's thread stays free, and coroutines are handed over with ``submit``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "new_event_loop"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it exists
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """Owns a loop running forever in a daemon thread until ``stop``."""

    def __init__(self, name: str = "asyncrpc-loop") -> None:
        self.loop = new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        loop = self.loop
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future is safe to wait on here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this (other) thread for its result."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait for the thread to end (bounded by ``timeout``)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if self.thread.is_alive():
            _log.warning("the asyncrpc loop thread did not stop within %.1f s", timeout)
