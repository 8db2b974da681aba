"""Batched releases of distributed autograd contexts (``asyncrpc.autograd.release``), on one
loop with fake ports that record the release calls instead of sending them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from asyncrpc.autograd import release as releasing
from asyncrpc.autograd.context import ContextTable
from asyncrpc.autograd.feature import release_here
from asyncrpc.errors import ConnectionLostError

pytestmark = pytest.mark.timeout(30)


class FakeAgent:
    """The ports the batcher is built from, in one: the Loop's (``aio``, ``run_on_loop``),
    the Calls' (``call``, ``closed``) and liveness (``is_lost``)."""

    def __init__(self, rank: int, loop: asyncio.AbstractEventLoop, fail_first: int = 0) -> None:
        self.rank = rank
        self.aio = loop
        self.closed = False
        self.calls: list[tuple[int, list[int], int]] = []  # (peer, context ids, sender)
        self.handoffs = 0
        self._fail_first = fail_first

    def run_on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        self.handoffs += 1
        self.aio.call_soon_threadsafe(fn, *args)

    async def call(self, peer: int, fn: Any, args: Any, kwargs: Any, timeout: float) -> None:
        assert fn is release_here
        self.calls.append((peer, list(args[0]), args[1]))
        if self._fail_first > 0:
            self._fail_first -= 1
            raise ConnectionLostError("dropped")

    def is_lost(self, peer: int) -> bool:
        return False


def _releases(agent: FakeAgent, table: ContextTable) -> releasing.Releases:
    ports: Any = agent
    return releasing.Releases(agent.rank, table, ports, ports, agent.is_lost, release_here)


def _context_reaching(table: ContextTable, rank: int, peers: set[int]) -> int:
    context = table.create(rank)
    context.peers.update(peers)
    return context.id


async def _settle(agent: FakeAgent, calls: int) -> None:
    for _ in range(200):  # bounded: 2 s
        if len(agent.calls) >= calls:
            return
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_contexts_left_together_go_in_one_call_per_peer() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    ids = [_context_reaching(table, 0, {1, 2}) for _ in range(3)]
    only_one = _context_reaching(table, 0, {2})

    def leave_all() -> None:  # from a user thread, as a training loop does
        for context_id in [*ids, only_one]:
            batcher.left(context_id)

    thread = threading.Thread(target=leave_all)
    thread.start()
    thread.join(10)
    assert len(table) == 0  # dropped here at once, on the leaving thread
    assert agent.handoffs == 1  # one wake-up of the loop for the whole batch
    assert agent.calls == []  # nothing sent before the batch delay
    await _settle(agent, 2)
    assert sorted(agent.calls) == [(1, ids, 0), (2, [*ids, only_one], 0)]


@pytest.mark.asyncio
async def test_a_context_that_stayed_here_sends_nothing() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    batcher.left(_context_reaching(table, 0, {0}))
    batcher.left(12345)  # unknown (released already): ignored
    await asyncio.sleep(releasing.BATCH_DELAY * 4)
    assert (agent.handoffs, agent.calls, len(table)) == (0, [], 0)


@pytest.mark.asyncio
async def test_flush_sends_at_once_and_a_later_context_starts_a_new_batch() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    first = _context_reaching(table, 0, {1})
    batcher.left(first)
    batcher.flush()  # what shutdown does: no waiting for the delay
    await asyncio.sleep(0)
    assert agent.calls == [(1, [first], 0)]
    second = _context_reaching(table, 0, {1})
    batcher.left(second)
    await _settle(agent, 2)
    assert agent.calls == [(1, [first], 0), (1, [second], 0)]


@pytest.mark.asyncio
async def test_a_release_lost_with_its_connection_is_sent_again() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop(), fail_first=1), ContextTable()
    batcher = _releases(agent, table)
    context_id = _context_reaching(table, 0, {3})
    batcher.left(context_id)
    await _settle(agent, 2)
    assert agent.calls == [(3, [context_id], 0), (3, [context_id], 0)]


@pytest.mark.asyncio
async def test_a_worker_passes_releases_on_to_the_workers_it_reached() -> None:
    # Worker 1 got contexts from worker 0 and reached workers 2 and 3 with them.
    agent, table = FakeAgent(1, asyncio.get_running_loop()), ContextTable()
    a = table.joined(100)
    a.peers.update({0, 2})
    b = table.joined(200)
    b.peers.update({0, 2, 3})
    _releases(agent, table).onward([100, 200, 300], sender=0)
    await _settle(agent, 2)
    assert sorted(agent.calls) == [(2, [100, 200], 1), (3, [200], 1)]
    assert len(table) == 0


@pytest.mark.asyncio
async def test_releases_ride_along_on_the_next_call_to_a_worker() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    first = _context_reaching(table, 0, {2, 3})
    second = _context_reaching(table, 0, {2})
    batcher.left(first)
    batcher.left(second)
    assert batcher.take_for(2) == [first, second]  # a call to worker 2 carries both
    assert batcher.take_for(2) == []
    assert batcher.carried == 2
    await _settle(agent, 1)
    assert agent.calls == [(3, [first], 0)]  # worker 3 saw no call: its batch went alone
    await asyncio.sleep(releasing.BATCH_DELAY * 4)
    assert agent.calls == [(3, [first], 0)]


@pytest.mark.asyncio
async def test_releases_of_a_failed_call_are_queued_again() -> None:
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    context_id = _context_reaching(table, 0, {2})
    batcher.left(context_id)
    carried = batcher.take_for(2)
    batcher.queue({2: carried})  # what the hook does when the call carrying them fails
    await _settle(agent, 1)
    assert agent.calls == [(2, [context_id], 0)]


class _Clock:
    """``time`` as release.py sees it, standing still until a test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.asyncio
async def test_a_timer_leaves_releases_younger_than_the_delay_to_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A training loop's steps are shorter than the delay: its timer must not take the
    # releases the next step's call is about to carry (one release call per timer, else).
    clock = _Clock()
    monkeypatch.setattr(releasing, "time", clock, raising=False)
    agent, table = FakeAgent(0, asyncio.get_running_loop()), ContextTable()
    batcher = _releases(agent, table)
    first = _context_reaching(table, 0, {2})
    batcher.left(first)
    await asyncio.sleep(releasing.BATCH_DELAY * 3)  # the timer fired: by the clock, no time
    assert agent.calls == []
    assert batcher.take_for(2) == [first]  # the next step's call carries it
    second = _context_reaching(table, 0, {2})
    batcher.left(second)
    clock.now += releasing.BATCH_DELAY  # no call came for a whole delay: it goes alone
    await _settle(agent, 1)
    assert agent.calls == [(2, [second], 0)]
    assert agent.handoffs <= 2  # armed from the leaving thread at most once per idle spell
    await asyncio.sleep(releasing.BATCH_DELAY * 3)
    assert agent.calls == [(2, [second], 0)]
