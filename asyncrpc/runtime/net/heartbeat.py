"""Liveness of peers: heartbeats on idle connections, and a probe of a silent peer's
process before it is declared lost (layer L2.2).

One loop timer per agent looks at each authenticated connection a few times per
``interval``: any byte received since the last look is a sign of life. A connection silent
for ``interval`` gets a Ping, which the peer's loop answers with a Pong at once, whatever
its thread pool is doing. Nothing is added to the per-read path: the timer compares byte
counters.

Silence alone is weak evidence: the peer's loop may be blocked by user code (a long
``@inline`` or ``async def`` that never yields) while its process is fine. So a connection
silent for ``timeout`` gets a second, independent test: a ``probe`` of the peer's process
that its loop takes no part in (the agent dials the peer's lane listener, served by a
thread of its own). No answer within the probe's deadline, or nobody listening any more, is
the second kind of evidence, and the peer is declared lost: a stopped or dead process is
found in about ``timeout`` plus the probe's deadline. A process that answers is alive: its
connection is given until ``silent_limit`` (a blocked loop, or a link that carries nothing),
and so is every connection when no probe can be made (lanes off, TLS).

A tick that comes late (this worker's own loop was blocked, or its process starved) judges
nobody: the bytes that arrived meanwhile are still unread, so the silence it would measure
is this worker's, not the peer's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["Heartbeat", "Probe", "ProbeAnswer"]

# What a probe tells: None when the peer's process answered (or the probe proves
# nothing), else the evidence that it did not (a sentence for the loss's reason).
ProbeAnswer = Callable[[str | None], None]


# A tick later than this past its time (seconds, beyond one period) judges nobody.
_LATE_S = 0.5


class Watched(Protocol):
    peer: int | None
    bytes_in: int

    @property
    def closed(self) -> bool: ...

    def send(self, pieces: Any, keepalive: object = None) -> None: ...


class Probe(Protocol):
    """Tests a silent peer's process without its event loop (``runtime/lanes/probe.py``)."""

    def __call__(self, conn: Watched, answer: ProbeAnswer) -> bool:
        """Start a probe of ``conn``'s peer; its answer comes back on the loop through
        ``answer``. False when none can be made (the peer takes no lanes)."""
        ...

    def notice(self, conn: Watched) -> None:
        """``conn`` is live: a chance to check, ahead of any silence, that its peer can be
        probed at all (a probe that never answered proves nothing)."""
        ...

    @property
    def checked(self) -> int:
        """Peers whose probe has answered from here: their silence can be tested."""
        ...


class Heartbeat:
    """Pings idle connections, probes silent peers and reports the ones found gone.

    Args:
        interval: seconds of silence after which a connection is pinged (0: off).
        timeout: seconds of silence after which the peer's process is probed.
        silent_limit: seconds of silence after which a connection is reported whatever
            its peer's process answers (at least ``timeout``).
        on_silent: ``(conn, seconds, evidence)`` for a connection whose peer is gone.
        probe: what tests a silent peer's process; None: silence alone decides, at
            ``silent_limit``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        timeout: float,
        connections: Callable[[], Iterable[Watched]],
        ping: Callable[[Watched], None],
        on_silent: Callable[[Watched, float, str], None],
        on_tick: Callable[[], None] | None = None,
        silent_limit: float | None = None,
        probe: Probe | None = None,
    ) -> None:
        self._loop = loop
        self._interval = interval
        self._timeout = timeout
        self._silent_limit = max(timeout, silent_limit or timeout)
        # A few looks per interval, so that a loss is declared soon after its evidence.
        self._period = min(interval, timeout / 4) if interval > 0 else 0.0
        self._connections = connections
        self._ping = ping
        self._on_silent = on_silent
        self._on_tick = on_tick  # more periodic work of the agent's (acknowledgements)
        self.probe = probe
        # Per connection: the byte count last seen, and when it last changed.
        self._heard: dict[Watched, tuple[int, float]] = {}
        # Per connection under probe: None while it runs, else when its process answered.
        self._probed: dict[Watched, float | None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._last_tick = 0.0
        self.probes = 0  # started
        self.probes_unanswered = 0  # whose evidence declared a peer lost

    def start(self) -> None:
        if self._period > 0 and self._timer is None:
            self._last_tick = self._loop.time()
            self._timer = self._loop.call_later(self._period, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heard.clear()
        self._probed.clear()

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self._period, self._tick)
        now = self._loop.time()
        late = now - self._last_tick > self._period + _LATE_S
        self._last_tick = now
        heard: dict[Watched, tuple[int, float]] = {}
        for conn in list(self._connections()):
            if conn.peer is None or conn.closed:
                continue  # in its handshake (which has its own deadline) or gone
            count, since = self._heard.get(conn, (-1, now))
            if conn.bytes_in != count or late:
                count, since = conn.bytes_in, now
                self._probed.pop(conn, None)
            heard[conn] = (count, since)
            if self.probe is not None:
                self.probe.notice(conn)
            self._judge(conn, now - since, now)
        self._heard = heard  # forgets connections that closed
        for conn in [c for c in self._probed if c not in heard]:
            del self._probed[conn]
        if self._on_tick is not None:
            self._on_tick()

    def _judge(self, conn: Watched, silent: float, now: float) -> None:
        if silent >= self._silent_limit:
            probed = self._probed.get(conn) is not None
            note = "; its process still answered probes" if probed else ""
            self._on_silent(conn, silent, f"no sign of life for {silent:.1f} s{note}")
            return
        if silent >= self._interval:
            self._ping(conn)
        if silent < self._timeout or self.probe is None:
            return
        if conn in self._probed:
            answered = self._probed[conn]
            if answered is None or now - answered < self._timeout:
                return  # a probe runs, or its process answered a moment ago
        self._probed[conn] = None
        if self.probe(conn, lambda evidence: self._answered(conn, evidence)):
            self.probes += 1
        else:
            del self._probed[conn]  # no probe for this peer: silence alone decides

    def _answered(self, conn: Watched, evidence: str | None) -> None:
        """A probe's answer, on the loop."""
        if conn not in self._probed or conn.closed:
            return  # the connection spoke meanwhile, or closed
        now = self._loop.time()
        if evidence is None:
            self._probed[conn] = now  # alive: its connection has until the silent limit
            return
        del self._probed[conn]
        count, since = self._heard.get(conn, (conn.bytes_in, now))
        if conn.bytes_in != count:
            return  # it spoke while the probe ran
        self.probes_unanswered += 1
        self._on_silent(conn, now - since, f"no sign of life for {now - since:.1f} s, {evidence}")
