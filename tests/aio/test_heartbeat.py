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


def stall(clock: FakeClock, seconds: float) -> None:
    """The loop was blocked for ``seconds``: time moves on, then the timers that fell due
    meanwhile run, late, at the new time."""
    clock.now += seconds
    while clock._timers and clock._timers[0][0] <= clock.now:
        _, _, timer, run_it = heapq.heappop(clock._timers)
        if not timer.cancelled:
            run_it()


def run(conns: list[FakeConn], seconds: float, chatty: FakeConn | None = None) -> dict:
    """Run a Heartbeat over ``conns`` for ``seconds`` of fake time, in 5 ms steps; a
    ``chatty`` connection receives bytes at every step."""
    clock = FakeClock()
    silent: dict[int, float] = {}
    pinged: list[int] = []
    beat = Heartbeat(
        clock, INTERVAL, TIMEOUT, lambda: conns,  # type: ignore[arg-type]
        lambda c: pinged.append(id(c)), lambda c, s, why: silent.setdefault(id(c), s),
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
        lambda c, s, why: reported.append(c),
    )  # fmt: skip
    beat.start()
    assert clock.pending() == 0  # no tick was ever scheduled
    clock.advance(0.2)
    beat.stop()
    assert reported == []


class Prober:
    """A probe whose answers the test gives: ``answer`` is what each probe says (None:
    the process answered), after ``delay`` seconds of fake time."""

    def __init__(self, clock: FakeClock, answer: str | None, delay: float = 0.01) -> None:
        self.clock, self.answer, self.delay = clock, answer, delay
        self.started: list[float] = []
        self.noticed = False

    def __call__(self, conn: Any, reply: Callable[[str | None], None]) -> bool:
        self.started.append(self.clock.now)
        self.clock.call_later(self.delay, reply, self.answer)
        return True

    def notice(self, conn: Any) -> None:
        self.noticed = True

    @property
    def checked(self) -> int:
        return 1


def probed(answer: str | None, seconds: float, limit: float = 1.0) -> dict[str, Any]:
    clock = FakeClock()
    quiet = FakeConn()
    reports: list[tuple[float, float, str]] = []
    prober = Prober(clock, answer)

    def silent(conn: FakeConn, seconds: float, why: str) -> None:
        reports.append((clock.now, seconds, why))
        conn.closed = True  # as the network does: it aborts the connection

    beat = Heartbeat(
        clock, INTERVAL, TIMEOUT, lambda: [quiet],  # type: ignore[arg-type]
        lambda c: None, silent,
        silent_limit=limit, probe=prober,  # type: ignore[arg-type]
    )  # fmt: skip
    beat.start()
    clock.advance(seconds)
    beat.stop()
    return {"reports": reports, "probes": prober.started, "beat": beat}


def test_Heartbeat_a_silent_peer_whose_process_does_not_answer_is_reported_at_once() -> None:
    seen = probed("and its process did not answer a probe within 1 s", 0.3)
    when, silent, why = seen["reports"][0]
    assert TIMEOUT <= when <= TIMEOUT + TIMEOUT / 4 + 0.011  # one look late, plus the probe
    assert silent >= TIMEOUT
    assert why.startswith("no sign of life for")
    assert "did not answer a probe" in why
    assert seen["probes"]
    assert seen["beat"].probes_unanswered == 1


def test_Heartbeat_a_silent_peer_whose_process_answers_waits_for_the_silent_limit() -> None:
    seen = probed(None, 1.5, limit=1.0)
    assert len(seen["reports"]) == 1
    when, silent, why = seen["reports"][0]
    assert when >= 1.0
    assert silent >= 1.0
    assert "still answered probes" in why
    # Probed again while it stays silent, once per TIMEOUT, not at every look.
    assert 5 <= len(seen["probes"]) <= 10, seen["probes"]
    assert seen["beat"].probes_unanswered == 0


def test_Heartbeat_without_a_probe_silence_alone_decides_at_the_silent_limit() -> None:
    clock = FakeClock()
    quiet = FakeConn()
    reports: list[float] = []
    beat = Heartbeat(
        clock, INTERVAL, TIMEOUT, lambda: [quiet],  # type: ignore[arg-type]
        lambda c: None, lambda c, s, why: reports.append(clock.now), silent_limit=0.5,
    )  # fmt: skip
    beat.start()
    clock.advance(1.0)
    beat.stop()
    assert reports
    assert 0.5 <= reports[0] < 0.6


def test_Heartbeat_a_probe_answered_after_the_peer_spoke_is_ignored() -> None:
    clock = FakeClock()
    conn = FakeConn()
    reports: list[str] = []
    prober = Prober(clock, "and its process did not answer", delay=0.05)
    beat = Heartbeat(
        clock, INTERVAL, TIMEOUT, lambda: [conn],  # type: ignore[arg-type]
        lambda c: None, lambda c, s, why: reports.append(why), silent_limit=1.0,
        probe=prober,  # type: ignore[arg-type]
    )  # fmt: skip
    beat.start()
    while not prober.started:
        clock.advance(0.005)
    conn.bytes_in += 1  # it spoke while its probe ran
    clock.advance(0.06)
    assert reports == []
    beat.stop()


def test_Heartbeat_a_late_tick_judges_nobody() -> None:
    # This worker's own loop was blocked for 2 s: the peer's bytes are unread, so the
    # silence the late tick would measure is ours. Nobody is reported or probed for it.
    clock = FakeClock()
    conn = FakeConn()
    reports: list[str] = []
    prober = Prober(clock, "and its process did not answer")
    beat = Heartbeat(
        clock, 0.2, 1.0, lambda: [conn],  # type: ignore[arg-type]
        lambda c: None, lambda c, s, why: reports.append(why), silent_limit=1.5,
        probe=prober,  # type: ignore[arg-type]
    )  # fmt: skip
    beat.start()
    clock.advance(0.25)  # one tick on time: it saw the connection's bytes
    stall(clock, 2.0)  # blocked: the tick due meanwhile runs late
    assert reports == []
    assert prober.started == []
    clock.advance(0.5)  # on time again: still within its limit
    assert reports == []
    assert prober.started == []
    clock.advance(0.6)  # 1.1 s of silence since the late tick: now it is probed
    assert prober.started
    assert reports
    beat.stop()
