"""``Bidi``: a bidirectional stream as the caller holds it, on any thread or loop (layer
L2.42).

A bidirectional stream is two streams of one call: the requests, which the callee's
function takes as its first argument and reads as a client stream (``sources.py``), and
the replies it yields, a server stream (``stream.py``). ``Bidi`` puts a sender over the
first (``send``, ``done_sending``) beside the iteration of the second, and ends both
together: when the replies end, in any way, nothing more can be sent; closing it closes
both.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from asyncrpc.errors import ClosedError
from asyncrpc.runtime.calls.streams.sources import SendQueue
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.futures import Future, try_set_exception

__all__ = ["Bidi"]

T = TypeVar("T")


class Bidi(Generic[T]):
    """A bidirectional stream: send requests with ``send``, iterate the replies.

    Made by ``asyncrpc.bidi``, ``asyncrpc.rpc_bidi`` and ``rref.bidi()``. Replies are
    iterated with ``async for`` or ``for`` (a ``Stream``); requests and replies flow
    independently, each within its own window. Leaving it early (``close``, ``async
    with``/``with``) closes both directions: the callee's function is closed as a
    stream's producer is.
    """

    __slots__ = ("__weakref__", "_loop_thread", "_queue", "_replies", "_run_on_loop")

    def __init__(
        self, replies: Stream[T], queue: SendQueue, loop_thread: int,
        run_on_loop: Callable[..., None],
    ) -> None:  # fmt: skip
        self._replies = replies
        self._queue = queue
        self._loop_thread = loop_thread
        self._run_on_loop = run_on_loop
        queue.why = lambda: replies.failure  # a send on a failed stream gets its error
        # However the replies end, nothing more is sent (on the loop, as they end).
        run_on_loop(replies.when_over, queue.stop)

    def __repr__(self) -> str:
        return f"<Bidi {self._replies!r}, {self._queue!r}>"

    @property
    def replies(self) -> Stream[T]:
        """The replies, as the ``Stream`` this object iterates."""
        return self._replies

    # -- sending -------------------------------------------------------------------------

    def send(self, item: Any) -> Future[None]:
        """Send ``item`` to the callee's function (any thread).

        Args:
            item: pickled as a call argument is, when the callee has credit for it.

        Returns:
            A ``Future`` completed once the item is queued: at once while fewer than the
            window's items wait, else when the callee has read enough (``await`` it, or
            ``.wait()`` in synchronous code). Cancelling it does not take the item back.

        Raises:
            ClosedError: (through the future) ``done_sending`` or ``close`` was called, or
                the stream is over (its replies ended, or the callee stopped reading).
            Exception: (through the future) the stream failed: the error its replies end
                with (``PeerLostError``, the callee's exception...).
        """
        if threading.get_ident() == self._loop_thread and self._queue.offer(item):
            return _QUEUED  # on the loop with room: queued now, no future to make
        done: Future[None] = Future()
        try:
            self._run_on_loop(self._queue.put, item, done)
        except RuntimeError:  # the loop is closed: its agent shut down
            try_set_exception(done, ClosedError("the worker sending on this stream has shut down"))
        return done

    def done_sending(self) -> None:
        """No more requests: the callee's iteration of them ends after those sent. Replies
        go on until its function returns. Returns at once; idempotent."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing left to end
            self._run_on_loop(self._queue.end)

    # -- the replies ---------------------------------------------------------------------

    # ``async for``/``for`` iterate the replies' ``Stream`` itself: nothing between it and
    # the items (the end of the replies stops the sending from the loop, see __init__).
    def __aiter__(self) -> Stream[T]:
        return self._replies

    def __anext__(self) -> Awaitable[T]:
        return self._replies.__anext__()

    def __iter__(self) -> Stream[T]:
        return self._replies

    def __next__(self) -> T:
        return self._replies.__next__()

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Close both directions: queued requests are dropped, waiting sends fail with
        ``ClosedError``, and the callee's function is closed (its ``finally`` runs).
        Returns at once; idempotent."""
        self._replies.close()
        self._stop_sending()

    async def aclose(self) -> None:
        """``close``, for ``async with`` and async code."""
        self.close()

    def _stop_sending(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: its agent is gone already
            self._run_on_loop(self._queue.stop)

    def __enter__(self) -> Bidi[T]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Bidi[T]:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# What ``send`` returns for an item queued at once on the loop: a future done with None.
# Shared: a done future holds nothing more (callbacks added to it are run, not kept).
_QUEUED: Future[None] = Future()
_QUEUED.set_result(None)
