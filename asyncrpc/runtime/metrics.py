"""Counters the agent keeps, an event-loop lag probe, a rate-limited log (layer L2).

Counters are plain ints bumped on the loop thread, so reading them costs nothing on the hot
path (the thread pool counts its own busy threads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

__all__ = ["Counters", "LagProbe", "RateLimitedLog"]


@dataclass(slots=True)
class Counters:
    """Monotonic counters of one agent."""

    calls_sent: int = 0
    calls_received: int = 0
    calls_on_loop: int = 0  # requests run on the event loop (async def, inline, small ops)
    replies_sent: int = 0
    errors_sent: int = 0
    calls_failed: int = 0
    calls_timed_out: int = 0
    calls_cancelled: int = 0
    calls_expired: int = 0  # requests served here whose caller's deadline passed first
    connections_opened: int = 0
    connections_lost: int = 0
    connections_idle_closed: int = 0  # closed by both sides' agreement (idle_timeout)
    protocol_errors: int = 0
    auth_failures: int = 0  # handshakes refused: wrong key, or none within the deadline
    handshake_timeouts: int = 0  # accepted connections with no handshake by the deadline
    silent_connections: int = 0  # closed by the heartbeat: its peer found gone (see heartbeat.py)
    stalled_frames: int = 0  # of those, closed in the middle of a frame
    reconnects: int = 0  # connections to a peer made after an earlier one was lost

    def statistics(self) -> dict[str, int]:
        return asdict(self)


class LagProbe:
    """Measures how late the loop runs a callback scheduled ``interval`` seconds ahead.

    The lag of the last tick and the worst lag seen are kept in milliseconds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 0.25) -> None:
        self._loop = loop
        self._interval = interval
        self._handle: asyncio.TimerHandle | None = None
        self._expected = 0.0
        self.last_ms = 0.0
        self.max_ms = 0.0

    def start(self) -> None:
        self._expected = time.monotonic() + self._interval
        self._handle = self._loop.call_later(self._interval, self._tick)

    def _tick(self) -> None:
        lag = max(0.0, time.monotonic() - self._expected) * 1000.0
        self.last_ms = lag
        self.max_ms = max(self.max_ms, lag)
        self.start()

    def statistics(self) -> dict[str, float]:
        """How late the loop ran, in milliseconds: at its last tick, and at worst."""
        return {"loop_lag_ms": round(self.last_ms, 3), "loop_lag_max_ms": round(self.max_ms, 3)}

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class RateLimitedLog:
    """At most one record per ``interval`` seconds; the next one says how many were skipped.

    For events a stranger can cause at will (refused connections): the log must not flood.
    """

    def __init__(self, logger: logging.Logger, interval: float) -> None:
        self._logger = logger
        self._interval = interval
        self._next = 0.0
        self._skipped = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        if self._skipped:
            message += f" (and {self._skipped} more in the last {self._interval:g} s)"
        self._skipped, self._next = 0, now + self._interval
        self._logger.warning(message, *args)
