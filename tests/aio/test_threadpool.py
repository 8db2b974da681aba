"""asyncio tests of the WorkerPool (threads/pool.py): real threads posting to a real loop."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest

from asyncrpc.errors import ClosedError, ThreadPoolExhaustedError
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.threads.pool import WorkerPool
from tests.ordering import until_async

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


async def _pool(size: int) -> WorkerPool:
    return WorkerPool(size, asyncio.get_running_loop(), "test")


async def test_WorkerPool_run_returns_value_from_a_pool_thread() -> None:
    pool = await _pool(2)
    loop_thread = threading.get_ident()
    try:
        ident = await pool.run(threading.get_ident)
        assert ident != loop_thread
        assert await pool.run(pow, 2, 10) == 1024
    finally:
        pool.shutdown()


async def test_WorkerPool_run_raises_the_job_exception() -> None:
    pool = await _pool(1)
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run(divmod, 1, 0)
    finally:
        pool.shutdown()


async def test_WorkerPool_blocked_job_does_not_starve_the_next() -> None:
    # The first job blocks until the second runs: with one thread this would deadlock.
    pool = await _pool(4)
    gate = threading.Event()
    waited = asyncio.get_running_loop().create_future()
    try:
        pool.submit(lambda: pool.post(waited.set_result, gate.wait(5.0)))
        await pool.run(gate.set)
        assert await waited is True  # set by the second job, not timed out
        assert pool.threads == 2
    finally:
        gate.set()
        pool.shutdown()


async def test_WorkerPool_never_exceeds_its_size() -> None:
    pool = await _pool(3)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> None:
        started.release()
        gate.wait(5.0)

    try:
        for _ in range(10):
            pool.submit(hold)
        for _ in range(3):
            assert await asyncio.to_thread(started.acquire, True, 5.0)
        assert pool.threads == 3
        assert pool.busy == 3
    finally:
        gate.set()
        pool.shutdown()


async def test_WorkerPool_post_runs_every_callback_on_the_loop_in_order() -> None:
    pool = await _pool(4)
    loop_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []
    done = asyncio.Event()
    count = 200

    def record(i: int) -> None:
        seen.append((i, threading.get_ident()))
        if len(seen) == count:
            done.set()

    def burst() -> None:
        for i in range(count):
            pool.post(record, i)

    try:
        pool.submit(burst)
        async with asyncio.timeout(5):
            await done.wait()
        assert [i for i, _ in seen] == list(range(count))
        assert {ident for _, ident in seen} == {loop_thread}
    finally:
        pool.shutdown()


async def test_WorkerPool_failing_callback_does_not_strand_later_ones() -> None:
    pool = await _pool(1)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    later = loop.create_future()

    def boom() -> None:
        raise ValueError("callback failed")

    def both() -> None:
        pool.post(boom)
        pool.post(later.set_result, "ran")

    try:
        pool.submit(both)
        async with asyncio.timeout(5):
            assert await later == "ran"
        assert isinstance(errors[0]["exception"], ValueError)
    finally:
        loop.set_exception_handler(None)
        pool.shutdown()


async def test_WorkerPool_cancelled_job_never_runs() -> None:
    pool = await _pool(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        pool.submit(gate.wait, 5.0)  # occupies the only thread
        skipped = pool.submit(ran.append, "skipped")
        skipped.cancel()
        gate.set()
        await pool.run(ran.append, "after")
        assert ran == ["after"]
    finally:
        gate.set()
        pool.shutdown()


async def test_WorkerPool_submit_after_shutdown_raises_closed() -> None:
    pool = await _pool(1)
    await pool.run(int)
    pool.shutdown()
    with pytest.raises(ClosedError):
        pool.submit(int)


async def test_WorkerPool_idle_thread_keeps_no_reference_to_its_last_job() -> None:
    pool = await _pool(1)

    class Token:
        pass

    token = Token()
    ref = weakref.ref(token)
    try:
        await pool.run(id, token)
        del token
        # run() returns when the job is done, maybe before its thread is back in its
        # queue wait: wait for that (bounded), then the token must be gone.
        await until_async(lambda: pool.busy == 0, what="the thread idle again")
        gc.collect()
        assert ref() is None
    finally:
        pool.shutdown()


async def test_WorkerPool_thread_start_failure_raises_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = await _pool(2)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(ClosedError):
        pool.submit(int)
    assert pool.threads == 0
    monkeypatch.undo()
    assert await pool.run(int, "7") == 7  # a later submit starts a thread normally
    pool.shutdown()


async def test_WorkerPool_stopped_waits_for_idle_threads_not_for_a_blocked_job() -> None:
    pool = await _pool(4)
    gate = threading.Event()
    try:
        await asyncio.gather(*(pool.run(int) for _ in range(3)))
        pool.shutdown()
        assert await pool.stopped(timeout=5.0)
        assert not any(t.name.startswith("asyncrpc-test") for t in threading.enumerate())

        blocked = await _pool(1)
        started = threading.Event()
        blocked.submit(lambda: (started.set(), gate.wait(5.0)))
        assert await asyncio.to_thread(started.wait, 5.0)
        blocked.shutdown()
        assert not await blocked.stopped(timeout=0.05)
        gate.set()
        assert await blocked.stopped(timeout=5.0)
    finally:
        gate.set()


async def test_WorkerPool_run_fails_with_closed_when_shutdown_drops_its_job() -> None:
    pool = await _pool(1)
    gate = threading.Event()
    started = threading.Event()
    try:
        pool.submit(lambda: (started.set(), gate.wait(5.0)))  # occupies the only thread
        assert await asyncio.to_thread(started.wait, 5.0)
        queued = asyncio.ensure_future(pool.run(int, "1"))
        # The run() job is queued behind the blocked one.
        await until_async(lambda: pool._queued == 1, what="the job queued")
        pool.shutdown()
        with pytest.raises(ClosedError):
            async with asyncio.timeout(5):
                await queued
    finally:
        gate.set()


async def test_WorkerPool_thread_blocked_on_a_future_gets_a_stand_in() -> None:
    # One thread, blocked on a future that only the next job completes: a stand-in runs it.
    pool = WorkerPool(1, asyncio.get_running_loop(), "test", max_threads=3)
    fut: Future[int] = Future()
    try:
        first = asyncio.ensure_future(pool.run(fut.wait, 5.0))
        await pool.run(fut.set_result, 7)
        assert await first == 7
        assert pool.blocked == 0
    finally:
        pool.shutdown()


async def test_WorkerPool_at_its_cap_with_every_thread_blocked_refuses_jobs() -> None:
    pool = WorkerPool(1, asyncio.get_running_loop(), "test", max_threads=1)
    fut: Future[int] = Future()
    try:
        first = asyncio.ensure_future(pool.run(fut.wait, 5.0))
        for _ in range(200):  # bounded: until the thread blocks
            if pool.blocked:
                break
            await asyncio.sleep(0.005)
        with pytest.raises(ThreadPoolExhaustedError) as info:
            await pool.run(fut.set_result, 7)
        assert info.value.cap == 1
        assert pool.refused == 1
        fut.set_result(8)
        assert await first == 8
        assert await pool.run(pow, 2, 3) == 8  # usable again once the wait is over
    finally:
        pool.shutdown()


async def test_WorkerPool_stand_ins_exit_when_their_job_is_done() -> None:
    pool = WorkerPool(1, asyncio.get_running_loop(), "test", max_threads=8)
    futs: list[Future[int]] = [Future() for _ in range(4)]
    try:
        waits = [asyncio.ensure_future(pool.run(f.wait, 5.0)) for f in futs]
        for _ in range(400):  # bounded: until all four block
            if pool.blocked == 4:
                break
            await asyncio.sleep(0.005)
        assert pool.threads == 4
        for i, f in enumerate(futs):
            f.set_result(i)
        assert await asyncio.gather(*waits) == [0, 1, 2, 3]
        for _ in range(400):  # bounded: the surplus threads leave after their job
            if pool.threads == 1:
                break
            await asyncio.sleep(0.005)
        assert pool.threads == 1
    finally:
        pool.shutdown()


async def test_WorkerPool_statistics_count_the_jobs_waiting_for_a_thread() -> None:
    pool = await _pool(1)
    gate, started = threading.Event(), threading.Event()
    try:
        pool.submit(lambda: (started.set(), gate.wait(5.0)))
        assert await asyncio.to_thread(started.wait, 5.0)
        for _ in range(3):
            pool.submit(lambda: None)  # the one thread is busy: these wait
        figures = pool.statistics()
        assert (figures["thread_pool_busy"], figures["thread_pool_queued"]) == (1, 3)
        gate.set()
        await until_async(lambda: pool.statistics()["thread_pool_queued"] == 0, 5.0)
    finally:
        gate.set()
        pool.shutdown()
