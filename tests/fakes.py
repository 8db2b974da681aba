"""Stand-ins shared by the in-process tests of the call path."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrpc.protocol.wire.messages import Request
from asyncrpc.runtime.calls.pending import (
    EncodedRequest,
    Observed,
    PendingCall,
    PendingCalls,
    Waiter,
)


def pending_call(
    waiter: Waiter, peer: int = 1, target: str = "fn", timeout: float = 0.0, *,
    call_id: int = 0, observed: Observed | None = None, calls: PendingCalls | None = None,
) -> PendingCall:  # fmt: skip
    """A pending call made from a request with no frame (what the tests of the table and
    of the hooks' ``completed`` stage need of it)."""
    request = EncodedRequest(call_id, peer, target, timeout, [], None, observed, None)
    return PendingCall(waiter, request, calls)


class NoRRefs:
    """The RRef layer's side the dispatcher uses (``OwnerValues``), holding no reference."""

    def take_unconfirmed(self) -> None:
        return None

    def undelivered(self, rank: int, forks: Any) -> None:
        pass

    def on_remote_request(self, peer: int, request: Request) -> None:
        pass

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        self.kept = (request.call_id, ok, value)

    def expire_value(self, request: Request) -> bool:
        return False


class NoProducers:
    """The producing side of streams as the dispatcher asks it, for tests serving none."""

    def expect(self, conn: Any, peer: int, stream_id: int, target: str) -> None:
        raise AssertionError("no stream request is expected here")

    def forget(self, peer: int, stream_id: int) -> None:
        raise AssertionError("no stream request is expected here")

    def start(self, *args: Any) -> None:
        raise AssertionError("no stream request is expected here")


async def settled(awaitable: Any, turns: int = 50) -> bool:
    """Whether ``awaitable`` finishes within a few loop turns (it stays pending otherwise)."""
    task = asyncio.ensure_future(awaitable)
    for _ in range(turns):  # bounded; the CUDA gate polls with sleeps from 20 us
        if task.done():
            break
        await asyncio.sleep(0.001)
    if not task.done():
        task.cancel()
        return False
    task.result()
    return True
