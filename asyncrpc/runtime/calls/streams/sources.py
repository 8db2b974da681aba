"""The caller's side of client streams: iterables sent as stream arguments, until their
callee opens them (layer L2.42).

A client stream is a server stream the other way round. The caller registers its iterable
here when it pickles the argument, and the argument travels as a small handle (this
worker's name and the entry's id). The callee's unpickler opens an ordinary stream back to
the caller on that handle, and the caller's ``Producers`` drive the iterable within the
callee's credit. So credit, byte windows, cancellation, errors, peer loss and shutdown are
those of server streams, in the other direction, with nothing new on the wire.

``SendQueue`` is the iterable behind a bidirectional stream's sender: the application puts
items into it from any thread; the producer takes them on the loop, only with credit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from asyncrpc.errors import ClosedError, StreamArgError
from asyncrpc.runtime.futures import Future, try_set_exception, try_set_result

__all__ = ["NOTHING", "SendQueue", "Sources"]

NOTHING = object()  # ``SendQueue.take_now``: no item is queued now

_log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("claimed_by", "deadline", "items")

    def __init__(self, items: Any, deadline: float | None) -> None:
        self.items = items
        self.deadline = deadline  # monotonic; still unclaimed then, it is closed
        self.claimed_by: int | None = None  # the rank that received the handle


class Sources:
    """Iterables this worker sent as stream arguments and no callee has opened yet.

    ``add`` runs on the thread that pickles a call (any thread), the rest on the loop.
    They touch the table only with single dict operations (atomic in CPython), so none
    takes a lock the loop could wait on.

    An entry's life: the callee that unpickles the handle claims it (a small call back:
    it arrived), and opens it when its function first reads it (``take``: the stream owns
    the iterable from then on), or releases it when it drops the handle unread
    (``discard``). An entry also goes, its iterable closed, when its claimer is lost, when
    this worker shuts down, and, never claimed, ``expiry`` seconds after it was sent: the
    request that carried it failed before its callee read it (an argument after it could
    not be pickled, the peer was lost), and the call failed with that.

    Args:
        close: closes an iterable nobody will read (on the loop: it runs its ``finally``
            where it may block).
        expiry: seconds an entry waits to be claimed (0: forever).
    """

    def __init__(
        self, close: Callable[[Any], None], expiry: float,
        later: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:  # fmt: skip
        self._close = close
        self._expiry = expiry
        # Runs a sweep after a delay, on the loop (from any thread): an unclaimed entry is
        # closed at its expiry even when nothing else happens here (None: on activity only).
        self._later = later
        self._sweeping = False  # a sweep is scheduled
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)  # next() on a count is atomic under the GIL
        self.taken = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def unclaimed(self) -> int:
        """Entries whose request has not (yet) been seen to arrive."""
        return sum(1 for entry in self._entries.copy().values() if entry.claimed_by is None)

    def add(self, items: Any) -> int:
        """Hold ``items`` for a callee (any thread); returns the id its handle carries."""
        deadline = time.monotonic() + self._expiry if self._expiry > 0 else None
        source_id = next(self._ids)
        self._entries[source_id] = _Entry(items, deadline)
        if deadline is not None and not self._sweeping and self._later is not None:
            self._sweeping = True  # two threads may both schedule one: harmless
            self._later(self._expiry, self._swept)
        return source_id

    def _swept(self) -> None:
        # The scheduled sweep (loop): again while an entry still waits for its expiry.
        self._sweeping = False
        self._sweep()
        waiting = [e.deadline for e in self._entries.copy().values() if e.deadline is not None]
        if waiting and self._later is not None:
            self._sweeping = True
            self._later(max(0.0, min(waiting) - time.monotonic()), self._swept)

    def claim(self, source_id: int, peer: int) -> None:
        """Worker ``peer`` received the handle: the entry waits for it, without expiry,
        until it opens or releases it, or is lost (loop)."""
        entry = self._entries.get(source_id)
        if entry is not None:
            entry.deadline, entry.claimed_by = None, peer
        self._sweep()

    def take(self, source_id: int) -> Any:
        """The callee opened ``source_id``: its iterable, now the stream's (loop).

        Raises:
            StreamArgError: no such entry: opened already (a stream argument is read
                once), released, expired unclaimed, or this worker shut down.
        """
        self._sweep()
        entry = self._entries.pop(source_id, None)
        if entry is None:
            raise StreamArgError(
                f"stream argument {source_id} is not held here: it was read already "
                f"(a stream argument is read once), or released, or it expired unread"
            )
        self.taken += 1
        return entry.items

    def discard(self, source_id: int) -> None:
        """The callee dropped the handle unread: the iterable is closed (loop)."""
        entry = self._entries.pop(source_id, None)
        if entry is not None:
            self._close(entry.items)

    def drop_peer(self, peer: int) -> None:
        """Worker ``peer`` is lost: the entries it claimed will never be read (loop)."""
        for source_id, entry in self._entries.copy().items():
            if entry.claimed_by == peer:
                self.discard(source_id)

    def _sweep(self) -> None:
        now = time.monotonic()
        for source_id, entry in self._entries.copy().items():
            expired = entry.deadline is not None and entry.deadline < now
            if expired and self._entries.pop(source_id, None) is not None:
                _log.debug("stream argument %d expired unclaimed", source_id)
                self._close(entry.items)

    def close_all(self) -> None:
        """This worker stops: every iterable still held is closed (loop)."""
        for source_id in list(self._entries.copy()):
            self.discard(source_id)


class SendQueue:
    """The items a bidirectional stream's sender sent, until the producer takes them.

    An async iterator on the agent's loop: the stream's producer advances it only with the
    callee's credit, so a callee that stops reading stops it, and ``put`` waits while
    ``limit`` items are queued (a sender's memory stays within its queue and the window).
    ``put`` and ``end`` run on the loop (``Bidi`` hands them over from other threads).
    """

    __slots__ = (
        "_ended", "_items", "_limit", "_loop", "_putters", "_stopped", "_waiter", "why",
    )  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop = loop
        # Why the stream is over, if it failed (a lost peer, say): a send gets that error
        # rather than a bare ClosedError. Set by the ``Bidi`` (its replies' failure).
        self.why: Callable[[], BaseException | None] = lambda: None
        self._limit = max(1, limit)
        self._items: deque[Any] = deque()
        self._putters: deque[tuple[Any, Future[None]]] = deque()  # waiting for room
        self._waiter: asyncio.Future[None] | None = None  # the producer waits for an item
        self._ended = False  # the sender is done: the stream ends after the queued items
        self._stopped = False  # the stream is over: nothing more is taken

    def __repr__(self) -> str:
        return f"<SendQueue {len(self._items)} queued, {len(self._putters)} waiting>"

    @property
    def queued(self) -> int:
        """Items sent and not yet taken by the producer (those waiting for room too)."""
        return len(self._items) + len(self._putters)

    def put(self, item: Any, done: Future[None]) -> None:
        """Queue ``item``; ``done`` completes once it is queued (at once while there is
        room), or fails with ``ClosedError`` if the stream can take no more."""
        if self._stopped or self._ended:
            try_set_exception(done, self._refusal())
        elif self.offer(item):
            try_set_result(done, None)
        else:
            self._putters.append((item, done))

    def offer(self, item: Any) -> bool:
        """Queue ``item`` if there is room now and the stream takes items; whether it did."""
        if self._stopped or self._ended or len(self._items) >= self._limit or self._putters:
            return False
        self._items.append(item)
        if self._waiter is not None:
            self._wake()
        return True

    def end(self) -> None:
        """The sender is done: the callee's iteration ends after the items sent."""
        self._ended = True
        self._wake()

    def stop(self) -> None:
        """The stream is over (closed, failed, or its callee stopped reading): items not
        taken are dropped and waiting sends fail."""
        if self._stopped:
            return
        self._stopped = True
        self._items.clear()
        putters, self._putters = self._putters, deque()
        for _, done in putters:
            try_set_exception(done, self._refusal())
        self._wake()

    def _refusal(self) -> BaseException:
        if not self._stopped:
            return ClosedError("cannot send on this stream: done_sending() was called")
        return self.why() or ClosedError("cannot send on this stream: the stream is over")

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the producer's side (an async iterator, driven by calls/streams/producer.py) --------

    def __aiter__(self) -> SendQueue:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._stopped or self._ended:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            await self._waiter
        return self.take_now()

    def take_now(self) -> Any:
        """The next item if one is queued, else ``NOTHING`` (then ``__anext__`` waits for
        one, or ends): the producer takes a queued item without a coroutine per item."""
        if not self._items:
            return NOTHING
        item = self._items.popleft()
        if self._putters:  # room for the first sender waiting
            queued, done = self._putters.popleft()
            self._items.append(queued)
            try_set_result(done, None)
        return item

    async def aclose(self) -> None:
        """The producer closes it: its consumer closed the stream, or it ended."""
        self.stop()
