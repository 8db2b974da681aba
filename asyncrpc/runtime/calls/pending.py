"""The table of outgoing calls awaiting a reply (layer L2, used on the agent's loop only).

Each pending call holds its waiter (an ``asyncrpc.Future`` for thread-side callers, or an
``asyncio.Future`` for coroutines on the agent's loop), the peer, and its deadline slot.
Whatever ends a call first (reply, error, timeout, cancellation, lost peer) pops it, so a
call completes exactly once. Timeouts share one loop timer (``Deadlines``).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Iterator
from typing import Any

from asyncrpc.functions import per_callable_cache
from asyncrpc.protocol.reflog import Transfer
from asyncrpc.runtime.calls.pipeline import CallHook, OutgoingCall, Pipeline
from asyncrpc.runtime.futures import Future

__all__ = ["Deadlines", "PendingCall", "PendingCalls", "Waiter", "describe_function"]

Waiter = Future[Any] | asyncio.Future[Any]


class PendingCall:
    """One call in flight."""

    __slots__ = (
        "forks", "keepalive", "observed", "peer", "sent_on", "slot", "target", "timeout",
        "waiter",
    )  # fmt: skip

    def __init__(
        self, waiter: Waiter, peer: int, target: str, timeout: float, keepalive: object = None,
        observed: tuple[tuple[CallHook, ...], OutgoingCall] | None = None,
        forks: list[Transfer] | None = None,
    ) -> None:  # fmt: skip
        self.waiter = waiter
        self.peer = peer
        self.target = target
        self.timeout = timeout
        self.slot = 0  # its Deadlines slot; 0: no timeout
        # The connection its request was written on (None: still waiting for one); losing
        # that connection fails the call, losing another one does not.
        self.sent_on: object = None
        # Tensors whose memory is being written; freed with the call, not before.
        self.keepalive = keepalive
        # The RRef forks its request carries (None: none), followed until the peer reads it.
        self.forks = forks
        # The pipeline hooks this call went through, told when it ends (None: none).
        self.observed = observed

    def resolve(self, value: Any, headers: dict[str, Any] | None = None) -> None:
        waiter = self.waiter
        if self.observed is not None:
            hooks, call = self.observed
            call.result = value
            Pipeline.completed(hooks, call, headers, None)
            if call.on_value is not None and isinstance(waiter, Future):
                waiter._on_value = call.on_value
        if isinstance(waiter, Future):
            # Not done()-then-set: the caller's thread may cancel it in between.
            waiter._try_set_result(value)
        elif not waiter.done():
            waiter.set_result(value)

    def fail(self, exc: BaseException, headers: dict[str, Any] | None = None) -> None:
        if self.observed is not None:
            Pipeline.completed(*self.observed, headers, exc)
        waiter = self.waiter
        if isinstance(waiter, Future):
            waiter._try_set_exception(exc)
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

    def add(self, call_id: int, call: PendingCall) -> None:
        if call.timeout > 0:  # first: a failure here leaves nothing registered
            call.slot = self.deadlines.add(call_id, call.timeout)
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

    # -- what the network asks of the calls it carries (asyncrpc.runtime.net.links.SentCalls)

    def wanted(self, call_id: int) -> bool:
        return call_id in self._calls

    def written(self, call_id: int, conn: object) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            call.sent_on = conn  # losing this connection fails it

    def unsent(self, call_id: int, exc: BaseException) -> bool:
        call = self.pop(call_id)
        if call is None:
            return False
        call.fail(exc)
        return True

    def pop_peer(self, peer: int, sent_on: object = None) -> Iterator[PendingCall]:
        """Remove and yield every call waiting on ``peer`` (the peer is gone), or only those
        written on the connection ``sent_on`` (that connection is gone)."""
        lost = [
            cid
            for cid, call in self._calls.items()
            if call.peer == peer and (sent_on is None or call.sent_on is sent_on)
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
            counts[call.peer] = counts.get(call.peer, 0) + 1
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
