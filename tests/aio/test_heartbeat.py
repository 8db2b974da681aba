"""Tests of asyncrpc.runtime.net.heartbeat.Heartbeat with fake connections and a fake clock.

The Heartbeat reads time and schedules its ticks only through the loop it is given
(``loop.time``, ``loop.call_later``), so a ``FakeClock`` in its place (trio's MockClock is
the model) moves time only when the test says: each test is exact, whatever the machine's
load, and takes no real time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from asyncrpc.runtime.net.heartbeat import Heartbeat

pytestmark = pytest.mark.timeout(10)

INTERVAL, TIMEOUT = 0.02, 0.1


class FakeConn:
    def __init__(self, peer: int | None = 1) -> None:
        self.peer = peer
        self.bytes_in = 0
        self.closed = False
        self.sent: list[Any] = []

    def send(self, pieces: Any, keepalive: object = None) -> None:
        self.sent.append(pieces)


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """The part of a loop the Heartbeat uses: a clock and timers that run on ``advance``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._order = itertools.count()  # timers due at the same time run in call order
        self._timers: list[tuple[float, int, FakeTimer, Callable[[], object]]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> FakeTimer:
        timer = FakeTimer()
        entry = (self.now + delay, next(self._order), timer, lambda: callback(*args))
        heapq.heappush(self._timers, entry)
        return timer

    def pending(self) -> int:
        return sum(1 for _, _, timer, _ in self._timers if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead, running each timer that falls due, in order."""
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, run = heapq.heappop(self._timers)
            self.now = when
            if not timer.cancelled:
                run()
        self.now = end


def run(conns: list[FakeConn], seconds: float, chatty: FakeConn | None = None) -> dict:
    """Run a Heartbeat over ``conns`` for ``seconds`` of fake time, in 5 ms steps; a
    ``chatty`` connection receives bytes at every step."""
    clock = FakeClock()
    silent: dict[int, float] = {}
    pinged: list[int] = []
    beat = Heartbeat(
        clock, INTERVAL, TIMEOUT, lambda: conns,  # type: ignore[arg-type]
        lambda c: pinged.append(id(c)), lambda c, s: silent.setdefault(id(c), s),
    )  # fmt: skip
    beat.start()
    for _ in range(round(seconds / 0.005)):
        if chatty is not None:
            chatty.bytes_in += 10  # a peer that keeps talking
        clock.advance(0.005)
    beat.stop()
    assert clock.pending() == 0  # stop() leaves no tick behind
    return {"silent": silent, "pinged": pinged}


def test_Heartbeat_silent_connection_is_pinged_then_reported() -> None:
    quiet = FakeConn()
    seen = run([quiet], 0.3)
    assert id(quiet) in seen["pinged"]
    assert seen["silent"][id(quiet)] >= TIMEOUT


def test_Heartbeat_connection_that_receives_is_never_reported() -> None:
    chatty = FakeConn()
    seen = run([chatty], 0.3, chatty=chatty)
    assert seen["silent"] == {}
    assert seen["pinged"] == []


def test_Heartbeat_skips_handshaking_and_closed_connections() -> None:
    handshaking, closed = FakeConn(peer=None), FakeConn()
    closed.closed = True
    seen = run([handshaking, closed], 0.3)
    assert seen == {"silent": {}, "pinged": []}


def test_Heartbeat_interval_zero_is_off() -> None:
    clock = FakeClock()
    quiet = FakeConn()
    reported: list[object] = []
    beat = Heartbeat(
        clock, 0, TIMEOUT, lambda: [quiet], reported.append,  # type: ignore[arg-type]
        lambda c, s: reported.append(c),
    )  # fmt: skip
    beat.start()
    assert clock.pending() == 0  # no tick was ever scheduled
    clock.advance(0.2)
    beat.stop()
    assert reported == []
