"""``LoopInbox``: work handed to the loop from other threads runs in order, with one loop
wake-up per batch; a failing item is reported and the rest still run."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from asyncrpc.runtime.threads.loopinbox import LoopInbox
from tests.ordering import until_async

pytestmark = pytest.mark.timeout(30)


class CountingLoop:
    """A loop's ``call_soon_threadsafe`` that counts the wake-ups asked of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> Any:
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(fn, *args)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        self.loop.call_exception_handler(context)


@pytest.mark.asyncio
async def test_a_burst_from_one_thread_runs_in_order_in_one_wakeup() -> None:
    loop = CountingLoop(asyncio.get_running_loop())
    inbox = LoopInbox(loop, "thread_to_loop")  # type: ignore[arg-type]
    seen: list[tuple[int, bool]] = []
    done = asyncio.Event()
    loop_thread = threading.get_ident()

    def item(n: int) -> None:
        seen.append((n, threading.get_ident() == loop_thread))
        if n == 99:
            done.set()

    def burst() -> None:
        for n in range(100):
            inbox.put(item, (n,))

    thread = threading.Thread(target=burst)
    thread.start()  # the loop is blocked below until the thread is done: one batch
    thread.join(10)
    await asyncio.wait_for(done.wait(), 10)
    assert seen == [(n, True) for n in range(100)]
    assert loop.wakeups == 1


@pytest.mark.asyncio
async def test_items_after_a_drain_schedule_the_next_one() -> None:
    loop = CountingLoop(asyncio.get_running_loop())
    inbox = LoopInbox(loop, "thread_to_loop")  # type: ignore[arg-type]
    seen: list[int] = []
    for n in range(3):
        await asyncio.to_thread(inbox.put, seen.append, (n,))
        await until_async(lambda n=n: len(seen) > n, what=f"item {n} ran")
    assert seen == [0, 1, 2]
    assert loop.wakeups == 3


@pytest.mark.asyncio
async def test_a_failing_item_is_reported_and_the_rest_run() -> None:
    running = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    running.set_exception_handler(lambda _, context: reported.append(context))
    try:
        inbox = LoopInbox(running, "thread_to_loop")
        seen: list[int] = []

        def fail() -> None:
            raise KeyError("boom")

        def hand_over() -> None:
            inbox.put(seen.append, (1,))
            inbox.put(fail, ())
            inbox.put(seen.append, (2,))

        await asyncio.to_thread(hand_over)
        await until_async(lambda: len(seen) == 2, what="both good items ran")
    finally:
        running.set_exception_handler(None)
    assert seen == [1, 2]
    assert len(reported) == 1
    assert isinstance(reported[0]["exception"], KeyError)


def test_a_closed_loop_refuses_and_forgets_the_item() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    inbox = LoopInbox(loop, "thread_to_loop")
    with pytest.raises(RuntimeError, match="closed"):
        inbox.put(print, ("never",))
    with pytest.raises(RuntimeError, match="closed"):  # not stuck believing one is queued
        inbox.put(print, ("never",))
