"""Liveness of peers: heartbeats on idle connections (layer L2.2).

One loop timer per agent, every ``interval`` seconds, looks at each authenticated
connection: any byte received since the last look is a sign of life. A connection silent
for ``interval`` gets a Ping (which the peer's loop answers with a Pong at once, whatever
its thread pool is doing); one silent for ``timeout`` is declared dead, which fails the
calls waiting on it. Nothing is added to the per-read path: the timer compares byte
counters. A peer whose loop is blocked (a long ``@inline`` or ``async def`` that never
yields) cannot answer either, and looks dead once that lasts ``timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["Heartbeat"]


class Watched(Protocol):
    peer: int | None
    bytes_in: int

    @property
    def closed(self) -> bool: ...

    def send(self, pieces: Any, keepalive: object = None) -> None: ...


class Heartbeat:
    """Pings idle connections and reports silent ones."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        timeout: float,
        connections: Callable[[], Iterable[Watched]],
        ping: Callable[[Watched], None],
        on_silent: Callable[[Watched, float], None],
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self._loop = loop
        self._interval = interval
        self._timeout = timeout
        self._connections = connections
        self._ping = ping
        self._on_silent = on_silent
        self._on_tick = on_tick  # more periodic work of the agent's (acknowledgements)
        # Per connection: the byte count last seen, and when it last changed.
        self._heard: dict[Watched, tuple[int, float]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self._interval > 0 and self._timer is None:
            self._timer = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heard.clear()

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self._interval, self._tick)
        now = self._loop.time()
        heard: dict[Watched, tuple[int, float]] = {}
        for conn in list(self._connections()):
            if conn.peer is None or conn.closed:
                continue  # in its handshake (which has its own deadline) or gone
            count, since = self._heard.get(conn, (-1, now))
            if conn.bytes_in != count:
                count, since = conn.bytes_in, now
            heard[conn] = (count, since)
            silent = now - since
            if silent >= self._timeout:
                self._on_silent(conn, silent)
            elif silent >= self._interval:
                self._ping(conn)
        self._heard = heard  # forgets connections that closed
        if self._on_tick is not None:
            self._on_tick()
