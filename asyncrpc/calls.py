"""The table of outgoing calls awaiting a reply (layer L2, used on the agent's loop only).

Each pending call holds its waiter (an ``asyncrpc.Future`` for thread-side callers, or an
``asyncio.Future`` for coroutines on the agent's loop), the peer, and its timeout timer.
Whatever ends a call first (reply, error, timeout, cancellation, lost peer) pops it, so a
call completes exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from asyncrpc.functions import per_callable_cache
from asyncrpc.future import Future

__all__ = ["PendingCall", "PendingCalls", "describe_function"]

Waiter = Future[Any] | asyncio.Future[Any]


class PendingCall:
    """One call in flight."""

    __slots__ = ("keepalive", "peer", "target", "timeout", "timer", "waiter")

    def __init__(self, waiter: Waiter, peer: int, target: str, timeout: float) -> None:
        self.waiter = waiter
        self.peer = peer
        self.target = target
        self.timeout = timeout
        self.timer: asyncio.TimerHandle | None = None
        # Tensors whose memory is being written; freed with the call, not before.
        self.keepalive: object = None

    def resolve(self, value: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
        waiter = self.waiter
        if not waiter.done():
            waiter.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        waiter = self.waiter
        if not waiter.done():
            waiter.set_exception(exc)


class PendingCalls:
    """Pending calls by call id; the agent's loop is the only thread that touches it."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call_id: int, call: PendingCall) -> None:
        self._calls[call_id] = call

    def pop(self, call_id: int) -> PendingCall | None:
        return self._calls.pop(call_id, None)

    def pop_peer(self, peer: int) -> Iterator[PendingCall]:
        """Remove and yield every call waiting on ``peer`` (the peer is gone)."""
        lost = [cid for cid, call in self._calls.items() if call.peer == peer]
        for call_id in lost:
            yield self._calls.pop(call_id)

    def pop_all(self) -> Iterator[PendingCall]:
        calls, self._calls = self._calls, {}
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
