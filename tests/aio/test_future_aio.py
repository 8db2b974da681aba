"""asyncio tests of asyncrpc.runtime.futures: awaiting from any loop, callback loops, blocking."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import uvloop

from asyncrpc.errors import BlockingCallError
from asyncrpc.runtime.futures import Future, wait_all
from asyncrpc.runtime.futures.callbacks import check_not_blocking_loop, set_default_callback_loop
from tests.ordering import until, until_async

pytestmark = pytest.mark.timeout(10)


class LoopThread:
    """An event loop running forever in a background thread (like the agent's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop if loop is not None else asyncio.new_event_loop()
        started = threading.Event()
        self.loop.call_soon(started.set)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        assert started.wait(5)
        assert self.thread.ident is not None
        self.ident: int = self.thread.ident

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop thread and return (or raise) its outcome."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def agent_loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    set_default_callback_loop(lt.loop, lt.ident)
    yield lt
    set_default_callback_loop(None, None)
    lt.close()


def _awaiters(fut: Future[Any]) -> int:
    # An awaiting task leaves one wake-up hook on the future (none once it is done).
    return len(fut._hooks or ())


def _complete_once_awaited(fut: Future[Any], value: object, awaiters: int = 1) -> threading.Thread:
    """Complete ``fut`` from a new thread once ``awaiters`` tasks await it (bounded)."""

    def run() -> None:
        until(lambda: _awaiters(fut) >= awaiters, what="the awaiters")
        fut.set_result(value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _append(out: list[Any], item: object, _fut: object) -> None:
    out.append(item)


# -- awaiting ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_Future_await_completed_later_from_another_thread() -> None:
    fut: Future[str] = Future()
    thread = _complete_once_awaited(fut, "late")
    async with asyncio.timeout(5):
        assert await fut == "late"
    thread.join()


@pytest.mark.asyncio
async def test_Future_await_raises_stored_exception() -> None:
    fut: Future[int] = Future()
    fut.set_exception(KeyError("x"))
    with pytest.raises(KeyError):
        await fut


@pytest.mark.asyncio
async def test_Future_await_completed_on_same_loop() -> None:
    fut: Future[int] = Future(loop=asyncio.get_running_loop())
    asyncio.get_running_loop().call_later(0.01, fut.set_result, 3)
    async with asyncio.timeout(5):
        assert await fut == 3


def test_Future_await_from_two_loops_in_two_threads() -> None:
    fut: Future[int] = Future()
    results: dict[str, Any] = {}
    started = threading.Barrier(3)

    def await_in(name: str, new_loop: Any) -> None:
        async def main() -> int:
            started.wait(5)
            async with asyncio.timeout(5):
                return await fut

        with asyncio.Runner(loop_factory=new_loop) as runner:
            results[name] = (runner.run(main()), threading.get_ident())

    threads = [
        threading.Thread(target=await_in, args=("asyncio", asyncio.new_event_loop)),
        threading.Thread(target=await_in, args=("uvloop", uvloop.new_event_loop)),
    ]
    for thread in threads:
        thread.start()
    started.wait(5)
    until(lambda: _awaiters(fut) == 2, what="both loops awaiting")
    fut.set_result(11)
    for thread in threads:
        thread.join(5)
    assert {name: value for name, (value, _) in results.items()} == {"asyncio": 11, "uvloop": 11}
    assert results["asyncio"][1] == threads[0].ident
    assert results["uvloop"][1] == threads[1].ident


@pytest.mark.asyncio
async def test_Future_await_of_future_completed_on_another_loop(loop_thread: LoopThread) -> None:
    fut: Future[int] = Future(loop=loop_thread.loop)
    loop_thread.loop.call_soon_threadsafe(loop_thread.loop.call_later, 0.02, fut.set_result, 4)
    async with asyncio.timeout(5):
        assert await fut == 4


@pytest.mark.asyncio
async def test_Future_cancelled_awaiter_leaves_future_pending_and_usable() -> None:
    fut: Future[int] = Future()
    task = asyncio.create_task(asyncio.wait_for(fut, 5))
    await until_async(lambda: _awaiters(fut) == 1, what="the task awaiting")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not fut.done()
    assert not fut._hooks  # the cancelled awaiter left no hook behind
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fut, 0.01)
    assert not fut.done()
    fut.set_result(8)
    async with asyncio.timeout(5):
        assert await fut == 8


# -- callback loops ------------------------------------------------------------------------


def test_Future_callbacks_run_on_given_loop_not_inline(loop_thread: LoopThread) -> None:
    fut: Future[int] = Future(loop=loop_thread.loop)
    gate = threading.Event()
    ran = threading.Event()
    seen: list[int] = []
    loop_thread.loop.call_soon_threadsafe(gate.wait, 5)  # keep the loop busy

    def record(_: Future[int]) -> None:
        seen.append(threading.get_ident())
        ran.set()

    fut.add_done_callback(record)
    fut.set_result(1)
    assert not ran.is_set()  # set_result returned before the callback ran
    gate.set()
    assert ran.wait(5)
    assert seen == [loop_thread.ident]


@pytest.mark.asyncio
async def test_Future_callbacks_on_running_loop_are_scheduled_in_order() -> None:
    fut: Future[int] = Future(loop=asyncio.get_running_loop())
    order: list[int] = []
    for i in range(100):
        fut.add_done_callback(partial(_append, order, i))
    fut.set_result(0)
    assert order == []
    fut.add_done_callback(partial(_append, order, 100))
    assert order == []
    await asyncio.sleep(0)
    assert order == list(range(101))


def test_Future_callbacks_registered_on_agent_loop_run_there(agent_loop: LoopThread) -> None:
    fut: Future[int] = Future()
    seen: list[int] = []
    ran = threading.Event()

    def record(f: Future[int]) -> None:
        seen.extend([f.value(), threading.get_ident()])
        ran.set()

    async def register() -> None:  # async code: the callbacks stay on the loop
        fut.then(lambda f: f.value() + 1).add_done_callback(record)

    asyncio.run_coroutine_threadsafe(register(), agent_loop.loop).result(5)
    fut.set_result(1)
    assert ran.wait(5)
    assert seen == [2, agent_loop.ident]


def test_Future_callbacks_registered_in_sync_code_run_off_agent_loop(
    agent_loop: LoopThread,
) -> None:
    fut: Future[int] = Future()
    seen: list[int] = []
    ran = threading.Event()

    def record(f: Future[int]) -> None:
        seen.extend([f.value(), threading.get_ident()])
        ran.set()

    fut.then(lambda f: f.value() + 1).add_done_callback(record)
    agent_loop.loop.call_soon_threadsafe(fut.set_result, 1)
    assert ran.wait(5)
    assert seen[0] == 2
    assert seen[1] not in (agent_loop.ident, threading.get_ident())


def test_Future_callback_from_sync_code_may_wait_on_another_future(
    agent_loop: LoopThread,
) -> None:
    first: Future[int] = Future()
    second: Future[int] = Future()
    # Completed only by the loop, after `first`'s callback has started waiting on it.
    chained = first.then(lambda f: f.value() + second.wait(5))
    agent_loop.loop.call_soon_threadsafe(first.set_result, 1)
    agent_loop.loop.call_soon_threadsafe(agent_loop.loop.call_later, 0.05, second.set_result, 2)
    assert chained.wait(5) == 3


def test_Future_callbacks_from_sync_code_keep_registration_order(
    agent_loop: LoopThread,
) -> None:
    fut: Future[int] = Future()
    order: list[int] = []
    for i in range(50):
        fut.add_done_callback(partial(_append, order, i))
    last = fut.then(lambda f: None)
    agent_loop.loop.call_soon_threadsafe(fut.set_result, 0)
    last.wait(5)
    assert order == list(range(50))


def test_Future_then_returning_coroutine_runs_it_on_callback_loop(loop_thread: LoopThread) -> None:
    async def double(x: int) -> tuple[int, int]:
        await asyncio.sleep(0)
        return x * 2, threading.get_ident()

    fut: Future[int] = Future(loop=loop_thread.loop)
    chained = fut.then(lambda f: double(f.value()))
    fut.set_result(4)
    assert chained.wait(5) == (8, loop_thread.ident)


# -- blocking checks -----------------------------------------------------------------------


def test_check_not_blocking_loop_raises_only_on_agent_thread(agent_loop: LoopThread) -> None:
    check_not_blocking_loop()  # a plain thread may block
    with pytest.raises(BlockingCallError):
        agent_loop.call(check_not_blocking_loop)


def test_Future_wait_on_agent_thread_raises_when_not_done(agent_loop: LoopThread) -> None:
    pending: Future[int] = Future()
    with pytest.raises(BlockingCallError):
        agent_loop.call(pending.wait)
    with pytest.raises(BlockingCallError):
        agent_loop.call(wait_all, [pending])
    done: Future[int] = Future()
    done.set_result(5)
    assert agent_loop.call(done.wait) == 5
    assert agent_loop.call(wait_all, [done]) == [5]
    assert not pending.done()


# -- wrap ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_Future_wrap_coroutine_on_running_loop() -> None:
    async def work() -> int:
        await asyncio.sleep(0.01)
        return 6

    fut = Future.wrap(work())
    async with asyncio.timeout(5):
        assert await fut == 6


def test_Future_wrap_coroutine_from_thread_runs_on_agent_loop(agent_loop: LoopThread) -> None:
    async def where() -> int:
        return threading.get_ident()

    assert Future.wrap(where()).wait(5) == agent_loop.ident


@pytest.mark.asyncio
async def test_Future_wrap_asyncio_future_and_cancel_it() -> None:
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[int] = loop.create_future()
    ours = Future.wrap(afut)
    loop.call_soon(afut.set_result, 2)
    async with asyncio.timeout(5):
        assert await ours == 2
    other: asyncio.Future[int] = loop.create_future()
    ours2 = Future.wrap(other)
    assert ours2.cancel()
    await asyncio.sleep(0)
    assert other.cancelled()


def test_Future_wrap_asyncio_future_of_another_thread(loop_thread: LoopThread) -> None:
    afut: asyncio.Future[int] = loop_thread.call(loop_thread.loop.create_future)
    ours = Future.wrap(afut)
    loop_thread.loop.call_soon_threadsafe(afut.set_exception, KeyError("k"))
    with pytest.raises(KeyError):
        ours.wait(5)


@pytest.mark.asyncio
async def test_Future_wrap_cancelled_task_fails_with_cancelled_error() -> None:
    task = asyncio.create_task(asyncio.sleep(5))
    ours = Future.wrap(task)
    task.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await ours
    assert isinstance(ours.exception(), asyncio.CancelledError)
