"""Worker-side helpers of test_pipeline_gate.py: a log of arrivals and a hook that holds
the replies of one function until told to let them go."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrpc.functions import inline
from asyncrpc.runtime.calls.pipeline import CallHook, IncomingCall
from asyncrpc.runtime.current import current_agent

_arrivals: list[str] = []


@inline
def arrive(label: str) -> str:
    """Log ``label`` in the order requests reach this worker (on its loop)."""
    _arrivals.append(label)
    return label


@inline
def arrivals() -> list[str]:
    return list(_arrivals)


@inline
def forget_arrivals() -> None:
    _arrivals.clear()


class ReplyHold(CallHook):
    """Holds the replies of ``held_value`` until ``release_replies`` (on the loop)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.holding = 0

    def serves_all(self) -> bool:
        return True

    def reply_ready(self, call: IncomingCall) -> Any:
        if not call.target.endswith(".held_value"):
            return None
        self.holding += 1
        return self._wait()

    async def _wait(self) -> None:
        try:
            await self.released.wait()
        finally:
            self.holding -= 1


_hold: ReplyHold | None = None


@inline
def hold_replies() -> None:
    global _hold
    _hold = ReplyHold()
    current_agent().pipeline.add(_hold)


@inline
def held_value(x: int) -> int:
    return x * 2


@inline
def replies_held() -> int:
    return 0 if _hold is None else _hold.holding


@inline
def release_replies() -> None:
    global _hold
    assert _hold is not None
    _hold.released.set()
    current_agent().pipeline.remove(_hold)
    _hold = None
