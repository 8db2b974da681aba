"""asyncio tests of asyncrpc.runtime.calls.pending: the pending-call table and its timeout wheel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.runtime.calls.pending import Deadlines, PendingCalls
from tests.fakes import pending_call

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class Expiry:
    """Records expirations with the loop time they happened at."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.expired: list[tuple[int, float]] = []
        self.event = asyncio.Event()

    def __call__(self, call_id: int) -> None:
        self.expired.append((call_id, self.loop.time()))
        self.event.set()

    async def next(self) -> None:
        async with asyncio.timeout(5):
            await self.event.wait()
        self.event.clear()


async def test_Deadlines_expires_after_the_timeout_never_before() -> None:
    expiry = Expiry()
    deadlines = Deadlines(expiry.loop, expiry)
    start = expiry.loop.time()
    deadlines.add(1, 0.05)
    await expiry.next()
    ((call_id, when),) = expiry.expired
    assert call_id == 1
    assert when - start >= 0.05 - 0.002  # loop timers may run up to ~1 ms early
    assert when - start < 0.05 + Deadlines.RESOLUTION + 0.5


async def test_Deadlines_discarded_call_never_expires() -> None:
    expiry = Expiry()
    deadlines = Deadlines(expiry.loop, expiry)
    slot = deadlines.add(1, 0.02)
    deadlines.discard(1, slot)
    deadlines.add(2, 0.06)
    await expiry.next()
    assert [call_id for call_id, _ in expiry.expired] == [2]


async def test_Deadlines_shorter_timeout_added_later_fires_first() -> None:
    expiry = Expiry()
    deadlines = Deadlines(expiry.loop, expiry)
    deadlines.add(1, 30.0)
    deadlines.add(2, 0.03)
    await expiry.next()
    assert [call_id for call_id, _ in expiry.expired] == [2]
    deadlines.close()


async def test_Deadlines_many_finished_calls_leave_one_timer_for_the_live_one() -> None:
    expiry = Expiry()
    deadlines = Deadlines(expiry.loop, expiry)
    for call_id in range(1, 1001):  # steady traffic of calls that all completed
        deadlines.discard(call_id, deadlines.add(call_id, 0.02 + call_id * 1e-5))
    deadlines.add(5000, 0.2)
    await expiry.next()
    assert [call_id for call_id, _ in expiry.expired] == [5000]
    assert not deadlines._slots  # every emptied slot was dropped, none left to fire


async def test_PendingCalls_pop_stops_the_timeout() -> None:
    expiry = Expiry()
    calls = PendingCalls(expiry.loop, expiry)
    waiter = expiry.loop.create_future()
    calls.add(pending_call(waiter, 1, "fn", 0.02, call_id=7, calls=calls))
    calls.add(pending_call(expiry.loop.create_future(), 1, "fn", 0.05, call_id=8, calls=calls))
    popped = calls.pop(7)
    assert popped is not None
    popped.resolve("done")
    await expiry.next()
    assert [call_id for call_id, _ in expiry.expired] == [8]
    assert waiter.result() == "done"


async def test_PendingCalls_pop_peer_and_pop_all_return_each_call_once() -> None:
    expiry = Expiry()
    calls = PendingCalls(expiry.loop, expiry)
    for call_id, peer in ((1, 1), (2, 2), (3, 1)):
        calls.add(pending_call(expiry.loop.create_future(), peer, "fn", 5.0, call_id=call_id))
    assert calls.count_by_peer() == {1: 2, 2: 1}
    assert sorted(c.peer for c in calls.pop_peer(1)) == [1, 1]
    assert [c.peer for c in calls.pop_all()] == [2]
    assert len(calls) == 0


async def test_Deadlines_memory_follows_calls_in_flight_not_the_timeout() -> None:
    expiry = Expiry()
    deadlines = Deadlines(expiry.loop, expiry)
    for call_id in range(1, 5001):  # finished calls with a long timeout, 10 ms apart in slots
        slot = deadlines.add(call_id, 3600.0 + call_id * Deadlines.RESOLUTION)
        deadlines.discard(call_id, slot)
    assert deadlines._slots == {}
    assert len(deadlines._order) <= 64 + 1
    deadlines.close()


async def test_Deadlines_failing_expiry_does_not_strand_other_calls() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    expired: list[int] = []
    done = asyncio.Event()

    def expire(call_id: int) -> None:
        if call_id == 1:
            raise RuntimeError("expiry failed")
        expired.append(call_id)
        if call_id == 3:
            done.set()

    deadlines = Deadlines(loop, expire)
    try:
        deadlines.add(1, 0.02)
        deadlines.add(2, 0.02)  # (almost always) the failing call's slot
        deadlines.add(3, 0.15)  # a later slot: needs the timer re-armed after the failure
        async with asyncio.timeout(5):
            await done.wait()
        assert expired == [2, 3]
        assert isinstance(errors[0]["exception"], RuntimeError)
    finally:
        loop.set_exception_handler(None)
        deadlines.close()
