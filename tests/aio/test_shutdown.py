"""asyncio tests of the graceful shutdown's verdict on lost peers (a stub host and store)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrpc.errors import ShutdownError
from asyncrpc.runtime.group.shutdown import GracefulShutdown, ShutdownHost

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class ScriptedGroup:
    """A store group whose ``missing`` answers follow a script, then stay at the last one."""

    def __init__(self, *answers: list[int]) -> None:
        self._answers = list(answers)
        self.arrived: list[str] = []
        self.dynamic = False  # a static group: shutdown runs its barriers

    def arrive(self, tag: str) -> None:
        self.arrived.append(tag)

    def missing(self, tag: str) -> list[int]:
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


class NoRRefs:
    """An RRef service that holds no reference."""

    def release_all_users(self) -> None:
        pass

    def quiescent(self) -> bool:
        return True

    def owner_leaks(self) -> list[Any]:
        return []

    def report_leaks(self) -> None:
        pass


class StubHost:
    """A worker of rank 1 in a group of 3, with nothing in flight and no RRef held."""

    def __init__(self, store: ScriptedGroup, lost: set[int]) -> None:
        addresses = {1: SimpleNamespace(name="w1"), 2: SimpleNamespace(name="w2")}
        self.group: Any = SimpleNamespace(
            store=store, rank=1, world_size=3, addresses=addresses, dynamic=store.dynamic
        )
        self.rrefs: Any = NoRRefs()
        self._lost = lost
        self.probed: list[int] = []

    def calls_in_flight(self) -> int:
        return 0

    def requests_running(self) -> int:
        return 0

    def is_lost(self, rank: int) -> bool:
        return rank in self._lost

    def probe(self, rank: int) -> None:
        self.probed.append(rank)
        self._lost.add(rank)  # as if it refused the connection


def _shutdown(group: ScriptedGroup, lost: set[int]) -> GracefulShutdown:
    host: ShutdownHost = StubHost(group, lost)
    return GracefulShutdown(host)


async def test_GracefulShutdown_peer_that_arrived_then_left_is_not_dead() -> None:
    # w2 was missing at the first read, then arrived and closed its connections before
    # the liveness check: the second read of the store shows it arrived.
    group = ScriptedGroup([2], [])
    await _shutdown(group, lost={2}).run(time.monotonic() + 5)
    assert group.arrived == ["calls-done", "users-released", "closing", "left"]


async def test_GracefulShutdown_lost_peer_still_missing_is_reported_dead() -> None:
    group = ScriptedGroup([2])
    with pytest.raises(ShutdownError, match="w2") as info:
        await _shutdown(group, lost={2}).run(time.monotonic() + 5)
    assert "calls-done" in str(info.value)
    assert group.arrived == ["calls-done"]


async def test_GracefulShutdown_probes_a_worker_missing_too_long() -> None:
    # w2 was never contacted: nothing says it is lost until the probe finds it dead.
    group = ScriptedGroup([2])
    host = StubHost(group, lost=set())
    started = time.monotonic()
    with pytest.raises(ShutdownError, match="w2"):
        await GracefulShutdown(host).run(time.monotonic() + 5)
    assert host.probed == [2]
    assert time.monotonic() - started < 3.0  # the probe, not the 5 s deadline


async def test_GracefulShutdown_waits_for_a_live_peer_until_the_deadline() -> None:
    group = ScriptedGroup([1])
    with pytest.raises(ShutdownError, match="timed out"):
        await _shutdown(group, lost=set()).run(time.monotonic() + 0.1)
