"""The table of outgoing calls awaiting a reply (layer L2.4, used on the agent's loop only).

Each pending call holds its waiter (an ``asyncrpc.Future`` for thread-side callers, or an
``asyncio.Future`` for coroutines on the agent's loop), the ``EncodedRequest`` it was made
from, and its deadline slot. Whatever ends a call first (reply, error, timeout,
cancellation, lost peer) pops it, so a call completes exactly once. Timeouts share one loop
timer (``Deadlines``). A pending call is also what the network asks about the request
frame it carries (``SentCall``: still wanted? written where? could not be written).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from asyncrpc.functions import per_callable_cache
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.runtime.calls.pipeline import CallHook, OutgoingCall, Pipeline
from asyncrpc.runtime.futures import Future, on_value, try_set_exception, try_set_result

__all__ = [
    "Deadlines",
    "EncodedRequest",
    "Observed",
    "PendingCall",
    "PendingCalls",
    "Waiter",
    "describe_function",
]

Waiter = Future[Any] | asyncio.Future[Any]
# The pipeline hooks a call went through, with their view of it.
Observed = tuple[tuple[CallHook, ...], OutgoingCall]


class EncodedRequest(NamedTuple):
    """A request pickled and framed on the calling thread, ready to be written (immutable;
    a named tuple, not a frozen dataclass: it is made once per call, and a frozen
    dataclass's ``__init__`` cost three times as much).

    Attributes:
        call_id: its id, unique per caller.
        rank: the callee.
        target: what it runs, for errors and the hooks.
        timeout: seconds until it fails with ``RpcTimeoutError`` (0: never).
        pieces: the frame, as ``encode_frame`` returns it.
        keep: what keeps the memory of its zero-copy pieces valid until written (and, kept
            by its pending call, until the call ends).
        observed: the pipeline hooks it went through (None: no hook was active).
        forks: the RRef forks its payload carries (None: none), followed until the peer
            reads it.
        shared: whether a segment went into shared memory (a lane cannot carry it).
        coded: a coded call's reply decoder (``protocol/coded.py``), for a reply
            marked ``CODED_REPLY``; None: a plain call, its reply is pickled.
    """

    call_id: int
    rank: int
    target: str
    timeout: float
    pieces: list[Any]
    keep: object
    observed: Observed | None
    forks: list[ForkPair] | None
    shared: bool = False  # some segment went into shared memory (its tag names a chunk)
    coded: Callable[[Any, Sequence[object]], Any] | None = None


class PendingCall:
    """One call in flight: its waiter and the request it was made from."""

    __slots__ = ("_calls", "request", "sent_on", "slot", "waiter")

    def __init__(
        self, waiter: Waiter, request: EncodedRequest, calls: PendingCalls | None = None
    ) -> None:
        self.waiter = waiter
        self.request = request  # keeps its tensors alive until the call ends
        self._calls = calls  # the table it is registered in (None: none)
        self.slot = 0  # its Deadlines slot; 0: no timeout
        # The connection its request was written on (None: still waiting for one); losing
        # that connection fails the call, losing another one does not.
        self.sent_on: object = None

    @property
    def call_id(self) -> int:
        return self.request.call_id

    @property
    def peer(self) -> int:
        return self.request.rank

    # -- what the network asks of the request frame's call (asyncrpc.runtime.ports.SentCall)

    def wanted(self) -> bool:
        return self._calls is not None and self._calls.get(self.request.call_id) is self

    def written(self, conn: object) -> None:
        self.sent_on = conn  # losing this connection fails it

    def unsent(self, exc: BaseException) -> bool:
        if self._calls is None or self._calls.pop(self.request.call_id) is None:
            return False
        self.fail(exc)
        return True

    # -- ending ----------------------------------------------------------------------------

    def resolve(self, value: Any, headers: dict[str, Any] | None = None) -> None:
        waiter = self.waiter
        observed = self.request.observed
        if observed is not None:
            hooks, call = observed
            call.result = value
            Pipeline.completed(hooks, call, headers, None)
            if call.on_value is not None and isinstance(waiter, Future):
                on_value(waiter, call.on_value)
        if isinstance(waiter, Future):
            # Not done()-then-set: the caller's thread may cancel it in between.
            try_set_result(waiter, value)
        elif not waiter.done():
            waiter.set_result(value)

    def fail(self, exc: BaseException, headers: dict[str, Any] | None = None) -> None:
        observed = self.request.observed
        if observed is not None:
            Pipeline.completed(*observed, headers, exc)
        waiter = self.waiter
        if isinstance(waiter, Future):
            try_set_exception(waiter, exc)
        elif not waiter.done():
            waiter.set_exception(exc)


class Deadlines:
    """Call timeouts on a coarse wheel: one loop timer for every call, not one each.

    A deadline is rounded up to a slot of ``RESOLUTION`` seconds, so a call times out at
    most that much late. Adding and removing a call are a set operation each; the timer is
    armed for the earliest slot that still holds a call, so under steady traffic of fast
    calls it fires about once per timeout period. ``loop.call_later`` per call cost the
    caller 8-17% of its CPU (a handle and a libuv timer started and stopped every call).
    """

    RESOLUTION = 0.01

    __slots__ = ("_expire", "_loop", "_order", "_slots", "_timer", "_timer_slot")

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[int], None]) -> None:
        self._loop = loop
        self._expire = expire
        self._slots: dict[int, set[int]] = {}  # slot -> ids of the calls due in it
        self._order: list[int] = []  # heap of slots; may hold slots already dropped
        self._timer: asyncio.TimerHandle | None = None
        self._timer_slot = 0

    def add(self, call_id: int, timeout: float) -> int:
        """Register ``call_id`` to expire after ``timeout`` seconds; returns its slot."""
        slot = math.ceil((self._loop.time() + timeout) / self.RESOLUTION)
        ids = self._slots.get(slot)
        if ids is None:
            ids = self._slots[slot] = set()
            heapq.heappush(self._order, slot)
            # Every slot present is at or after the armed one (see _fire), so only a new
            # slot can need an earlier timer.
            if self._timer is None or slot < self._timer_slot:
                self._arm(slot)
        ids.add(call_id)
        return slot

    def discard(self, call_id: int, slot: int) -> None:
        """The call ended: it no longer expires."""
        ids = self._slots.get(slot)
        if ids is None:
            return
        ids.discard(call_id)
        if not ids:
            # Memory follows the calls in flight, not the timeout's length: drop the slot,
            # and rebuild the heap once most of its entries name dropped slots.
            del self._slots[slot]
            if len(self._order) > 2 * len(self._slots) + 64:
                self._order = list(self._slots)
                heapq.heapify(self._order)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._slots.clear()
        self._order.clear()

    def _arm(self, slot: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_slot = slot
        self._timer = self._loop.call_at(slot * self.RESOLUTION, self._fire)

    def _fire(self) -> None:
        self._timer = None
        due = (self._loop.time() + 0.001) / self.RESOLUTION  # loop timers may run ~1 ms early
        try:
            while self._order and self._order[0] <= due:  # bounded by the heap
                expired = self._slots.pop(heapq.heappop(self._order), None)
                for call_id in sorted(expired or ()):
                    self._expire_one(call_id)
        finally:  # whatever happened, the calls still pending keep a timer
            order, slots = self._order, self._slots
            while order and not slots.get(order[0]):  # drop emptied slots (bounded)
                slots.pop(heapq.heappop(order), None)
            if order and self._timer is None:
                self._arm(order[0])

    def _expire_one(self, call_id: int) -> None:
        try:
            self._expire(call_id)  # pops the call; its discard finds no slot
        except Exception as exc:  # one failure must not strand the other calls' timeouts
            self._loop.call_exception_handler(
                {"message": f"asyncrpc: expiring call {call_id} failed", "exception": exc}
            )


class PendingCalls:
    """Pending calls by call id; the agent's loop is the only thread that touches it.

    ``expire(call_id)`` runs when a call's timeout passes; it must pop the call.
    """

    __slots__ = ("_calls", "deadlines")

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[int], None]) -> None:
        self._calls: dict[int, PendingCall] = {}
        self.deadlines = Deadlines(loop, expire)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: PendingCall) -> None:
        call_id, timeout = call.request.call_id, call.request.timeout
        if timeout > 0:  # first: a failure here leaves nothing registered
            call.slot = self.deadlines.add(call_id, timeout)
        self._calls[call_id] = call

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    def pop(self, call_id: int) -> PendingCall | None:
        call = self._calls.pop(call_id, None)
        if call is not None and call.slot:
            self.deadlines.discard(call_id, call.slot)
        return call

    def get(self, call_id: int) -> PendingCall | None:
        return self._calls.get(call_id)

    def pop_peer(self, peer: int, sent_on: object = None) -> Iterator[PendingCall]:
        """Remove and yield every call waiting on ``peer`` (the peer is gone), or only those
        written on the connection ``sent_on`` (that connection is gone)."""
        lost = [
            cid
            for cid, call in self._calls.items()
            if call.request.rank == peer and (sent_on is None or call.sent_on is sent_on)
        ]
        for call_id in lost:
            call = self.pop(call_id)
            assert call is not None
            yield call

    def pop_all(self) -> Iterator[PendingCall]:
        calls, self._calls = self._calls, {}
        self.deadlines.close()
        yield from calls.values()

    def count_by_peer(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for call in self._calls.values():
            counts[call.request.rank] = counts.get(call.request.rank, 0) + 1
        return counts


@per_callable_cache
def describe_function(fn: Callable[..., Any] | Any) -> str:
    """Return ``module.qualname`` of ``fn`` for errors and metrics (cached per function)."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        qualified = getattr(fn, "qualified_name", None)  # TorchScript functions
        return str(qualified) if qualified else type(fn).__name__
    return f"{module}.{name}"
