"""``Stream``: what the application iterates, on any thread or loop (layer L2.42).

A ``Stream`` fetches batches of items from its ``ConsumerStream`` on the agent's loop and
hands them out one by one; the next fetch reports how many were taken, which becomes the
producer's credit. From the agent's own loop a fetch is a loop future; from another loop or
thread it is an ``asyncrpc.Future`` completed across threads, one hand-off per batch rather
than per item. Leaving it early in any way (``close``, ``async with``/``with``, a break
that drops it, a cancelled or timed-out consumer) closes the stream, which stops the
producer on the callee.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from asyncrpc.errors import BlockingCallError, ClosedError
from asyncrpc.runtime.calls.streams.consumer import Arrived, ConsumerStream
from asyncrpc.runtime.futures import Future

__all__ = ["Stream"]

T = TypeVar("T")


class Stream(Generic[T]):
    """The items of a streaming call, in order: ``async for``, ``for``, ``async with``.

    Made by ``asyncrpc.stream``, ``asyncrpc.rpc_stream`` and ``rref.stream()``. Iterate it
    once; leaving the loop early closes it (explicitly with ``close``/``aclose`` or a
    ``with`` block, or when the stream object is dropped).
    """

    __slots__ = (
        "__weakref__", "_buffer", "_closed", "_consumer", "_done", "_loop", "_loop_thread",
        "_run_on_loop", "_taken",
    )  # fmt: skip

    def __init__(
        self, consumer: ConsumerStream, loop: asyncio.AbstractEventLoop, loop_thread: int,
        run_on_loop: Callable[..., None],
    ) -> None:  # fmt: skip
        self._consumer = consumer
        self._loop = loop
        self._loop_thread = loop_thread
        self._run_on_loop = run_on_loop
        self._buffer: deque[Any] = deque()
        self._taken = 0  # items handed out since the last fetch (the next credit)
        self._done = False
        self._closed = False

    def __repr__(self) -> str:
        c = self._consumer
        state = "closed" if self._closed else "done" if self._done else "open"
        return f"<Stream {c.target} on {c.peer_name!r} ({state})>"

    def when_over(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) once the stream is over, however it ends; now if
        it is over already. Call on the agent's loop."""
        consumer = self._consumer
        if consumer.ended:
            callback()
        else:
            consumer.on_end = callback

    @property
    def failure(self) -> BaseException | None:
        """The error the stream ended with, once it ended with one (None: not ended, ended
        cleanly, or closed by this side)."""
        return self._consumer.failure

    # -- async ---------------------------------------------------------------------------

    def __aiter__(self) -> Stream[T]:
        return self

    async def __anext__(self) -> T:
        if not self._buffer:
            if self._done:
                raise StopAsyncIteration
            try:
                batch = await self._fetch_async()
            except BaseException:
                self._done = True
                self.close()  # cancelled, timed out, or the producer raised: nothing follows
                raise
            if not batch:
                self._done = True
                raise StopAsyncIteration
            self._buffer.extend(batch)
        self._taken += 1
        item = self._buffer.popleft()
        if type(item) is Arrived:  # ordered after the item's copies, on the reader's thread
            item = item.take()
        return item  # type: ignore[no-any-return]

    async def _fetch_async(self) -> list[Any]:
        taken, self._taken = self._taken, 0
        if asyncio.get_running_loop() is self._loop:
            waiter: asyncio.Future[list[Any]] = self._loop.create_future()
            self._consumer.fetch(taken, waiter)
            return await waiter
        future: Future[list[Any]] = Future(loop=self._loop)
        self._ask(taken, future)
        return await future

    def _ask(self, taken: int, future: Future[list[Any]]) -> None:
        try:
            self._run_on_loop(self._consumer.fetch, taken, future)
        except RuntimeError:  # the loop is closed: its agent shut down
            raise ClosedError("the worker consuming this stream has shut down") from None

    async def __aenter__(self) -> Stream[T]:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the stream (see ``close``); for ``async with`` and async code."""
        self.close()

    # -- sync ----------------------------------------------------------------------------

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        if not self._buffer:
            if self._done:
                raise StopIteration
            if threading.get_ident() == self._loop_thread:
                raise BlockingCallError(
                    "iterating a Stream with `for` would block the agent's event loop; "
                    "use `async for`"
                )
            taken, self._taken = self._taken, 0
            future: Future[list[Any]] = Future(loop=self._loop)
            try:
                self._ask(taken, future)
                batch = future.wait()
            except BaseException:
                self._done = True
                self.close()
                raise
            if not batch:
                self._done = True
                raise StopIteration
            self._buffer.extend(batch)
        self._taken += 1
        item = self._buffer.popleft()
        if type(item) is Arrived:  # ordered after the item's copies, on the reader's thread
            item = item.take()
        return item  # type: ignore[no-any-return]

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the stream: the producer's generator is closed on the callee (its
        ``finally`` blocks run) and the items not yet taken are dropped. Returns at once;
        safe to call again, and after the stream ended."""
        if self._closed:
            return
        self._closed = self._done = True
        self._buffer.clear()
        with contextlib.suppress(RuntimeError):  # a closed loop: the agent is gone already
            self._run_on_loop(self._consumer.close)

    def __del__(self) -> None:
        # Never I/O here: the close is scheduled on the agent's loop (a break out of a
        # `for` drops the stream, and this stops its producer).
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._loop.call_soon_threadsafe(self._consumer.close)
        except Exception:  # a closed loop, or an exiting interpreter: nothing left to stop
            return
