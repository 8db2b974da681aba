"""Stand-ins shared by the in-process tests of the call path."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrpc.protocol.wire.messages import Request


class NoRRefs:
    """The RRef service's side the outbox and dispatcher use, holding no reference."""

    def take_unconfirmed(self) -> None:
        return None

    def undelivered(self, rank: int, forks: Any) -> None:
        pass

    def on_remote_request(self, peer: int, request: Request) -> None:
        pass

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        self.kept = (request.call_id, ok, value)


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
