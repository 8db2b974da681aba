"""PeerWatchers and MemberEvents (asyncrpc/runtime/group/events.py), in one process.

Callbacks run on the callback pool: each test waits for them on an Event, bounded.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncrpc.errors import PeerLostError
from asyncrpc.protocol.options import WorkerInfo
from asyncrpc.runtime.group.events import MemberEvent, PeerWatchers

pytestmark = pytest.mark.timeout(10)


def lost(name: str = "w1", evidence: str = "silence") -> PeerLostError:
    return PeerLostError(name, "no sign of life for 1.3 s, and ...", evidence)


class Seen:
    def __init__(self, expect: int = 1) -> None:
        self.errors: list[PeerLostError] = []
        self._expect = expect
        self._done = threading.Event()

    def __call__(self, error: PeerLostError) -> None:
        self.errors.append(error)
        if len(self.errors) >= self._expect:
            self._done.set()

    def wait(self) -> list[PeerLostError]:
        assert self._done.wait(5.0), self.errors
        return self.errors


def test_PeerWatchers_a_loss_reaches_every_watcher_once() -> None:
    watchers = PeerWatchers()
    everyone, of_w1, of_w2 = Seen(), Seen(), Seen()
    watchers.watch_all(everyone)
    watchers.watch_peer(1, of_w1)
    watchers.watch_peer(2, of_w2)
    error = lost()
    watchers.on_gone(1, error, left=False)
    watchers.on_gone(1, error, left=False)  # declared twice: told once
    assert everyone.wait() == [error]
    assert of_w1.wait() == [error]
    watchers.watch_all(Seen())  # a barrier: the pool runs jobs in order per thread
    assert of_w2.errors == []


def test_PeerWatchers_a_peer_that_left_is_no_loss_but_ends_its_watches() -> None:
    watchers = PeerWatchers()
    everyone, of_w1 = Seen(), Seen()
    watchers.watch_all(everyone)
    watchers.watch_peer(1, of_w1)
    bye = PeerLostError("w1", "the worker shut down", "goodbye")
    watchers.on_gone(1, bye, left=True)
    assert of_w1.wait() == [bye]
    assert everyone.errors == []


def test_PeerWatchers_watching_a_peer_already_gone_tells_at_once() -> None:
    watchers = PeerWatchers()
    error = lost()
    watchers.on_gone(1, error, left=False)
    late = Seen()
    watchers.watch_peer(1, late)
    assert late.wait() == [error]


def test_PeerWatchers_unwatch_stops_the_callback() -> None:
    watchers = PeerWatchers()
    stopped, kept = Seen(), Seen()
    watchers.watch_peer(1, stopped)()
    watchers.watch_all(stopped)()
    watchers.watch_peer(1, kept)
    watchers.on_gone(1, lost(), left=False)
    kept.wait()
    assert stopped.errors == []


def test_MemberEvents_in_order_then_the_end_on_close() -> None:
    watchers = PeerWatchers()
    events = watchers.subscribe()

    async def consume() -> list[MemberEvent]:
        got = []
        async for event in events:
            got.append(event)
        return got

    async def main() -> list[MemberEvent]:
        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # it waits for the first event
        watchers.on_joined(WorkerInfo("w3", 3))
        # From another thread, as the agent's loop thread does.
        thread = threading.Thread(target=watchers.on_gone, args=(1, lost(), False))
        thread.start()
        thread.join()
        watchers.on_gone(2, PeerLostError("w2", "the worker shut down", "goodbye"), True)
        watchers.close()  # the worker shuts down: the iteration ends
        return await asyncio.wait_for(task, 5.0)

    got = asyncio.run(main())
    assert [(e.kind, e.worker.name, e.evidence) for e in got] == [
        ("joined", "w3", ""), ("lost", "w1", "silence"), ("left", "w2", "goodbye"),
    ]  # fmt: skip
    assert got[1].error is not None
    assert got[1].at > 0


def test_MemberEvents_async_with_closes_and_unsubscribes() -> None:
    watchers = PeerWatchers()

    async def main() -> list[str]:
        async with watchers.subscribe() as events:
            watchers.on_gone(1, lost(), left=False)
            first = await anext(events)
        watchers.on_gone(2, lost("w2"), left=False)  # nobody listens any more
        return [first.worker.name, str(len(watchers._subscribers))]

    assert asyncio.run(main()) == ["w1", "0"]
