"""Who joins and who leaves, told to the program (layer L2.3).

The network declares a peer gone (it said Goodbye, its redials were refused, or it fell
silent and its process did not answer a probe); the agent passes each such end here once,
and a member that joins a dynamic group after this worker is passed here when this worker
first meets it. From that, ``PeerWatchers`` serves what a program asks for:

- ``watch_all``: a callback for every loss (``asyncrpc.on_peer_lost``; a worker that left
  by shutting down is no loss);
- ``watch_peer``: a callback for one peer's end, loss or departure, once
  (``RRef.on_owner_lost``, ``asyncrpc.on_caller_lost``); at once if it is gone already;
- ``subscribe``: an async iterator of ``MemberEvent`` (``asyncrpc.membership()``).

Callbacks run on the callback pool, never on the loop: a callback may block, or call the
lost peer's neighbours, which the loop must stay free to serve. Any thread may watch;
events come from the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from asyncrpc.errors import PeerLostError
from asyncrpc.protocol.options import WorkerInfo
from asyncrpc.runtime.futures import callbacks

__all__ = ["MemberEvent", "MemberEvents", "PeerWatchers"]

_log = logging.getLogger(__name__)

LossCallback = Callable[[PeerLostError], None]


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """One change in the group, as this worker saw it.

    Attributes:
        kind: ``"joined"`` (a member that joined a dynamic group after this worker, when
            this worker first meets it), ``"left"`` (it shut down and said so) or
            ``"lost"`` (it died, hung or became unreachable).
        worker: the member's ``WorkerInfo``.
        evidence: how it was found: ``""`` for joined, ``"goodbye"`` for left,
            ``"silence"`` (no byte for the heartbeat's limit, and its process did not
            answer a probe) or ``"redial_refused"`` (its connection broke and redials were
            refused) for lost.
        reason: the same in words.
        error: for left and lost, the ``PeerLostError`` its pending calls failed with.
        at: when this worker saw it (``time.time()``).
    """

    kind: Literal["joined", "left", "lost"]
    worker: WorkerInfo
    evidence: str = ""
    reason: str = ""
    error: PeerLostError | None = None
    at: float = 0.0


class MemberEvents:
    """An async iterator of ``MemberEvent`` from the moment it was made, until ``close()``,
    the end of an ``async with``, or this worker's shutdown. It may be consumed on any
    event loop (the agent's, or the program's own); events wait in it meanwhile.
    """

    def __init__(self, unsubscribe: Callable[[MemberEvents], None]) -> None:
        self._unsubscribe = unsubscribe
        self._events: deque[MemberEvent] = deque()
        self._lock = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._closed = False

    def put(self, event: MemberEvent) -> None:
        """An event for the consumer (any thread)."""
        with self._lock:
            if self._closed:
                return
            self._events.append(event)
        self._wake()

    def close(self) -> None:
        """Stop: the iteration ends after the events already received."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._unsubscribe(self)
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                loop.call_soon_threadsafe(_settle, future)

    def __aiter__(self) -> MemberEvents:
        return self

    async def __anext__(self) -> MemberEvent:
        loop = asyncio.get_running_loop()
        while True:  # bounded: each pass either returns, raises, or waits for a wake-up
            with self._lock:
                if self._events:
                    return self._events.popleft()
                if self._closed:
                    raise StopAsyncIteration
                future = loop.create_future()
                self._waiter = (loop, future)
            try:
                await future
            except asyncio.CancelledError:
                with self._lock:
                    if self._waiter is not None and self._waiter[1] is future:
                        self._waiter = None
                raise

    async def __aenter__(self) -> MemberEvents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class PeerWatchers:
    """The program's watchers of peers joining and leaving, for one agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[LossCallback] = []
        self._by_peer: dict[int, list[LossCallback]] = {}
        self._gone: dict[int, PeerLostError] = {}
        self._subscribers: list[MemberEvents] = []

    # -- what the program asks for (any thread) --------------------------------------------

    def watch_all(self, callback: LossCallback) -> Callable[[], None]:
        """``callback(error)`` once for each peer lost from now on (not one that left)."""
        with self._lock:
            self._all.append(callback)

        def unwatch() -> None:
            with self._lock:
                if callback in self._all:
                    self._all.remove(callback)

        return unwatch

    def watch_peer(self, rank: int, callback: LossCallback) -> Callable[[], None]:
        """``callback(error)`` once when ``rank`` is gone (lost, or left); at once (on
        the callback pool) when it is gone already."""
        with self._lock:
            gone = self._gone.get(rank)
            if gone is None:
                self._by_peer.setdefault(rank, []).append(callback)
        if gone is not None:
            callbacks.submit(_tell, [(callback, gone)])

        def unwatch() -> None:
            with self._lock:
                watchers = self._by_peer.get(rank)
                if watchers and callback in watchers:
                    watchers.remove(callback)
                    if not watchers:
                        del self._by_peer[rank]

        return unwatch

    def subscribe(self) -> MemberEvents:
        """A new ``MemberEvents`` iterator."""
        events = MemberEvents(self._unsubscribe)
        with self._lock:
            self._subscribers.append(events)
        return events

    def _unsubscribe(self, events: MemberEvents) -> None:
        with self._lock:
            if events in self._subscribers:
                self._subscribers.remove(events)

    # -- what happened (the loop thread) -----------------------------------------------------

    def on_gone(self, rank: int, error: PeerLostError, left: bool) -> None:
        """``rank`` is gone for good: it ``left`` (said Goodbye), or was lost."""
        with self._lock:
            if rank in self._gone:
                return  # told once
            self._gone[rank] = error
            jobs = [(cb, error) for cb in self._by_peer.pop(rank, ())]
            if not left:
                jobs += [(cb, error) for cb in self._all]
            subscribers = list(self._subscribers)
        if jobs:
            callbacks.submit(_tell, jobs)
        if subscribers:
            kind: Literal["left", "lost"] = "left" if left else "lost"
            event = MemberEvent(
                kind, WorkerInfo(error.worker, rank), error.evidence or ("goodbye" if left else ""),
                error.reason, error, time.time(),
            )  # fmt: skip
            for events in subscribers:
                events.put(event)

    def on_joined(self, info: WorkerInfo) -> None:
        """A member that joined after this worker, met for the first time."""
        with self._lock:
            subscribers = list(self._subscribers)
        event = MemberEvent("joined", info, at=time.time())
        for events in subscribers:
            events.put(event)

    def close(self) -> None:
        """This worker shuts down: iterations end; peer watchers are dropped."""
        with self._lock:
            subscribers, self._subscribers = self._subscribers, []
            self._by_peer.clear()
            self._all.clear()
        for events in subscribers:
            events.close()


def _tell(jobs: list[tuple[LossCallback, PeerLostError]]) -> None:
    for watcher, error in jobs:
        try:
            watcher(error)
        except Exception:  # the program's own error: logged, the other watchers still run
            _log.exception("a callback for the end of worker %r failed", error.worker)
