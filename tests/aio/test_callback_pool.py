"""asyncio tests of asyncrpc.runtime.futures.callbackpool: jobs queued in one loop turn wake one
thread, order holds per thread, a blocked job does not hold the jobs behind it forever,
and nothing queued is lost at exit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncrpc.runtime.futures.callbackpool import CallbackPool

pytestmark = pytest.mark.timeout(10)


async def until(predicate: object, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 (a thread sets it)
            await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_jobs_of_one_loop_turn_wake_one_thread_and_run_in_order() -> None:
    pool = CallbackPool(4, stall=60.0)  # no stall check within the test
    ran: list[int] = []
    gate = threading.Event()
    pool.submit(lambda _: gate.wait(5), None)  # holds the woken thread until all are queued
    for i in range(100):
        pool.submit(ran.append, i)
    gate.set()
    await until(lambda: len(ran) == 100)
    assert ran == list(range(100))
    assert pool.wakeups == 1


@pytest.mark.asyncio
async def test_a_blocked_job_does_not_hold_the_one_it_waits_for() -> None:
    pool = CallbackPool(4)
    done = threading.Event()
    finished: list[str] = []

    def waiter(_: object) -> None:
        assert done.wait(5), "the job behind it never ran"
        finished.append("waiter")

    pool.submit(waiter, None)
    pool.submit(lambda _: done.set(), None)  # queued behind the job that waits for it
    await until(lambda: finished == ["waiter"])
    assert pool.wakeups == 2  # the second thread was woken by the stall check


@pytest.mark.asyncio
async def test_never_more_threads_than_its_size() -> None:
    pool = CallbackPool(2)
    # Count the stall checks (each one may wake a thread), instead of sleeping through some.
    checks = [0]
    check = pool._check

    def counted(loop: asyncio.AbstractEventLoop, finished_before: int) -> None:
        checks[0] += 1
        check(loop, finished_before)

    pool._check = counted  # type: ignore[method-assign]
    release = threading.Event()
    ran: list[int] = []
    for i in range(3):
        pool.submit(lambda _, i=i: (release.wait(5), ran.append(i)), None)
    await until(lambda: pool.pending() == 1)
    seen = checks[0]
    await until(lambda: checks[0] >= seen + 5)  # several stall checks: no third thread
    assert pool.pending() == 1
    assert threading.active_count() >= 2
    release.set()
    await until(lambda: len(ran) == 3)
    assert pool.wakeups == 2


def test_jobs_left_over_run_on_the_calling_thread() -> None:
    pool = CallbackPool(1)
    block, started = threading.Event(), threading.Event()
    pool.submit(lambda _: (started.set(), block.wait(5)), None)
    assert started.wait(5)
    ran: list[str] = []
    pool.submit(lambda _: ran.append(threading.current_thread().name), None)
    pool.run_left_over()
    assert ran == [threading.current_thread().name]
    block.set()
