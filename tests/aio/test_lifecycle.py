"""asyncio tests of the shutdown barrier's verdict on lost peers (stub agent and store)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrpc.errors import ShutdownError
from asyncrpc.runtime.shutdown import Lifecycle

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class ScriptedGroup:
    """A store group whose ``missing`` answers follow a script, then stay at the last one."""

    def __init__(self, *answers: list[int]) -> None:
        self._answers = list(answers)
        self.arrived: list[str] = []

    def arrive(self, tag: str) -> None:
        self.arrived.append(tag)

    def missing(self, tag: str) -> list[int]:
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


def _agent(group: ScriptedGroup, lost: set[int]) -> Any:
    peers = SimpleNamespace(peers={1: None, 2: None}, is_lost=lambda rank: rank in lost)
    addresses = {1: SimpleNamespace(name="w1"), 2: SimpleNamespace(name="w2")}
    return SimpleNamespace(group=group, world_size=3, peers=peers, addresses=addresses)


async def test_Lifecycle_barrier_peer_that_arrived_then_left_is_not_dead() -> None:
    # w2 was missing at the first read, then arrived and closed its connections before
    # the liveness check: the second read of the store shows it arrived.
    group = ScriptedGroup([2], [])
    lifecycle = Lifecycle(_agent(group, lost={2}))
    await lifecycle._barrier("closing", time.monotonic() + 5)
    assert group.arrived == ["closing"]


async def test_Lifecycle_barrier_lost_peer_still_missing_is_reported_dead() -> None:
    group = ScriptedGroup([2])
    lifecycle = Lifecycle(_agent(group, lost={2}))
    with pytest.raises(ShutdownError, match="w2"):
        await lifecycle._barrier("calls-done", time.monotonic() + 5)


async def test_Lifecycle_barrier_waits_for_a_live_peer_until_the_deadline() -> None:
    group = ScriptedGroup([1])
    lifecycle = Lifecycle(_agent(group, lost=set()))
    with pytest.raises(ShutdownError, match="timed out"):
        await lifecycle._barrier("calls-done", time.monotonic() + 0.1)
