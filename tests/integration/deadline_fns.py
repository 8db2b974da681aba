"""Functions the deadline tests run on workers (importable by worker processes)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncrpc

# What each worker's functions saw, by key: read back by the driver with ``seen``.
SEEN: dict[str, Any] = {}


async def sleeper(key: str, seconds: float) -> str:
    """Sleep, noting whether it was cancelled (its finally runs either way)."""
    SEEN[key] = "running"
    try:
        await asyncio.sleep(seconds)
        SEEN[key] = "finished"
        return "slept"
    except asyncio.CancelledError:
        SEEN[key] = ("stopped", time.time(), "CancelledError")
        raise


async def relay(key: str, to: str, seconds: float) -> str:
    """Call ``sleeper`` on ``to`` with no timeout of its own: it inherits this request's.
    Whichever stops it first is noted: the caller's cancel, or the inherited timeout of
    its own call (both come at the caller's deadline)."""
    SEEN[key] = "running"
    try:
        return str(await asyncrpc.call(to, sleeper, key, seconds))
    except BaseException as exc:
        SEEN[key] = ("stopped", time.time(), type(exc).__name__)
        raise


def seen(key: str) -> Any:
    return SEEN.get(key)


def remaining() -> float | None:
    return asyncrpc.time_remaining()


def nested_remaining(to: str) -> tuple[float | None, float | None]:
    """This request's budget, and the one a call made from here sees on ``to``."""
    mine = asyncrpc.time_remaining()
    return mine, asyncrpc.rpc_sync(to, remaining)
