"""The consuming side of one streaming call, on the agent's loop (layer L2.42).

Received items wait here, unpickled, until the application fetches them (``fetch``, from
the ``Stream`` it iterates); fetching reports the items consumed since the last fetch, and
``ConsumerFlow`` turns those into credit for the producer. The end of the stream comes
through the stream's ``PendingCall`` (see ``streams.py``): a ``StreamEnd`` or
``StreamError`` frame, an error reply (the function could not start), a lost peer or a
shutdown settles it, as for any call, and ``finished`` records the outcome, delivered after
the items received before it. A consumer waiting longer than its item timeout gets
``RpcTimeoutError`` and the stream is closed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from asyncrpc.errors import RpcTimeoutError
from asyncrpc.protocol.wire.stream import ConsumerFlow
from asyncrpc.runtime.calls.pipeline import ItemsIn, StreamLinks
from asyncrpc.runtime.futures import Future, try_set_exception, try_set_result

__all__ = ["Arrived", "ConsumerHub", "ConsumerStream", "Waiter"]

# What a fetch settles: an asyncrpc Future (a consumer on another thread or loop) or an
# asyncio future of the agent's loop. Its value: a list of items, empty at the end.
Waiter = Future[list[Any]] | asyncio.Future[list[Any]]


class Arrived:
    """An item whose reader must call ``first`` on its own thread before it gets the
    value (CUDA: its current streams wait for the item's copies to the device)."""

    __slots__ = ("first", "value")

    def __init__(self, value: Any, first: Callable[[], None]) -> None:
        self.value, self.first = value, first

    def take(self) -> Any:
        """The value, once ``first`` ran (call it on the thread that reads the item)."""
        self.first()
        return self.value


class ConsumerHub(Protocol):
    """What a consumer asks of the stream hub (``hub.py``)."""

    def grant(self, stream: ConsumerStream, count: int, nbytes: int) -> None:
        """Send the producer a credit of ``count`` items and ``nbytes`` bytes."""

    def close_stream(self, stream: ConsumerStream) -> None:
        """Close the stream: the producer stops."""


class ConsumerStream:
    """The state of one stream this worker consumes; touched on the agent's loop only."""

    __slots__ = (
        "_handing", "_hub", "_loop", "_outcome", "_timer", "_waiter", "closed", "ended", "failure",
        "flow", "items", "items_in", "links", "on_end", "peer", "peer_name", "serving",
        "stream_id", "target", "timeout",
    )  # fmt: skip

    def __init__(
        self, loop: asyncio.AbstractEventLoop, stream_id: int, peer: int, peer_name: str,
        target: str, timeout: float, window: int, hub: ConsumerHub, window_bytes: int = 0,
    ) -> None:  # fmt: skip
        self._loop = loop
        self.stream_id = stream_id
        self.peer = peer
        self.peer_name = peer_name
        self.target = target
        self.timeout = timeout  # seconds a fetch may wait for the next item (0: forever)
        self.flow = ConsumerFlow(window, window_bytes)
        self.items: deque[Any] = deque()
        self.ended = False  # the outcome is known (it follows the items still buffered)
        self.closed = False  # closed by this side: nothing more is delivered
        self._outcome: BaseException | None = None
        self.failure: BaseException | None = None  # the error it ended with, kept
        self._waiter: Waiter | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._handing = False  # a hand-off to the waiting fetch is scheduled
        self._hub = hub
        # A stream argument of a request this worker serves: read as part of serving it,
        # so a graceful shutdown does not close it (see StreamHub.flush).
        self.serving = False
        # Told once when the stream is over, however it ends (a bidirectional stream's
        # sender stops then).
        self.on_end: Callable[[], None] | None = None
        # The hooks' policy of its items (set as it opens; None: the defaults).
        self.items_in: ItemsIn | None = None
        # What the hooks add to its frames to the producer (None: nothing; CUDA IPC).
        self.links: StreamLinks | None = None

    # -- from the hub ------------------------------------------------------------------------

    def on_item(self, seq: int, value: Any) -> None:
        """Item ``seq`` arrived (checked in order and within the window by the hub)."""
        if self.closed:
            return
        self.items.append(value)
        if self._waiter is not None and not self._handing:
            # Next loop pass, not now: the other frames of this read come first, and the
            # waiting consumer takes them all at once (one wake-up per batch, not per item).
            self._handing = True
            self._loop.call_soon(self._hand_soon)

    def _hand_soon(self) -> None:
        self._handing = False
        self._hand()

    def finished(self, outcome: BaseException | None) -> None:
        """The stream's end is known: ``outcome`` is its error, or None for a clean end."""
        if self.ended:
            return
        self.ended, self._outcome = True, outcome
        self.failure = outcome
        self._ending()
        self._hand()

    def shut(self, error: BaseException | None) -> None:
        """Closed by this side: drop the items; a waiting fetch gets ``error`` or the end."""
        self.closed = self.ended = True
        self.items.clear()
        self._outcome = error
        self.failure = self.failure or error
        self._ending()
        self._hand()

    def _ending(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    # -- from the application ----------------------------------------------------------------

    def close(self) -> None:
        """Close the stream (idempotent): the producer stops."""
        if not self.closed:
            self._hub.close_stream(self)

    def fetch(self, consumed: int, waiter: Waiter) -> None:
        """Hand the next items to ``waiter``, now or when they come; ``consumed``: items the
        application took from the previous batch."""
        if consumed and not self.closed:
            count, nbytes = self.flow.consumed(consumed)
            if count:
                self._hub.grant(self, count, nbytes)
        previous, self._waiter = self._waiter, waiter
        if previous is not None:  # an abandoned fetch (its consumer was cancelled)
            _settle(previous, [], None)
        self._hand()
        if self._waiter is not None and self.timeout > 0 and self._timer is None:
            self._timer = self._loop.call_later(self.timeout, self._expire)

    def _hand(self) -> None:
        waiter = self._waiter
        if waiter is None:
            return
        if waiter.done():  # cancelled while waiting: keep the items for the next fetch
            self._waiter = None
            self._stop_timer()
            return
        if self.items:
            count = min(len(self.items), max(1, self.flow.window // 2))
            batch = [self.items.popleft() for _ in range(count)]
            self._deliver(batch, None)
        elif self.ended:
            outcome, self._outcome = self._outcome, None  # raised once; then the end
            self._deliver([], outcome)

    def _deliver(self, batch: list[Any], error: BaseException | None) -> None:
        waiter, self._waiter = self._waiter, None
        self._stop_timer()
        assert waiter is not None
        _settle(waiter, batch, error)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._waiter is None:
            return
        error = RpcTimeoutError(self.peer_name, self.target, self.timeout)
        waiter, self._waiter = self._waiter, None
        _settle(waiter, [], error)
        self._hub.close_stream(self)  # a timeout stops the producer too


def _settle(waiter: Waiter, batch: list[Any], error: BaseException | None) -> None:
    if isinstance(waiter, Future):
        if error is None:
            try_set_result(waiter, batch)
        else:
            try_set_exception(waiter, error)
    elif not waiter.done():
        if error is None:
            waiter.set_result(batch)
        else:
            waiter.set_exception(error)
