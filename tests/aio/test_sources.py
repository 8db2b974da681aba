"""asyncio tests of the caller's side of client streams in one process, without an agent:
the table of sent stream arguments and the bidirectional sender's queue
(``runtime/calls/streams/sources.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.errors import ClosedError, PeerLostError, StreamArgError
from asyncrpc.runtime.calls.streams.sources import NOTHING, SendQueue, Sources
from asyncrpc.runtime.futures import Future

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]


async def test_Sources_an_argument_is_taken_once() -> None:
    closed: list[Any] = []
    sources = Sources(closed.append, expiry=0.0)
    items = [1, 2, 3]
    source_id = sources.add(items)
    assert len(sources) == 1
    assert sources.take(source_id) is items
    assert len(sources) == 0
    with pytest.raises(StreamArgError):
        sources.take(source_id)
    assert closed == []  # taken: the stream owns it, nothing closes it here


async def test_Sources_an_unread_argument_is_closed_after_its_expiry() -> None:
    closed: list[Any] = []
    sources = Sources(closed.append, expiry=0.05)
    stale = sources.add(["stale"])
    await asyncio.sleep(0.06)
    fresh = sources.add(["fresh"])
    assert sources.take(fresh) == ["fresh"]  # taking sweeps what expired meanwhile
    assert closed == [["stale"]]
    with pytest.raises(StreamArgError):
        sources.take(stale)


async def test_Sources_a_claimed_argument_does_not_expire() -> None:
    closed: list[Any] = []
    sources = Sources(closed.append, expiry=0.05)
    source_id = sources.add(["slow reader"])
    sources.claim(source_id, peer=3)  # its request arrived at worker 3
    await asyncio.sleep(0.06)
    sources.add(["another"])
    assert sources.take(source_id) == ["slow reader"]  # read late, still there
    assert closed == []


async def test_Sources_discard_and_a_lost_claimer_close_the_iterable() -> None:
    closed: list[Any] = []
    sources = Sources(closed.append, expiry=0.0)
    dropped, lost, kept = sources.add(["dropped"]), sources.add(["lost"]), sources.add(["kept"])
    sources.discard(dropped)  # the callee dropped it unread
    sources.claim(lost, peer=2)
    sources.claim(kept, peer=5)
    sources.drop_peer(2)  # worker 2 is lost: what it claimed will never be read
    assert closed == [["dropped"], ["lost"]]
    assert len(sources) == 1
    sources.discard(dropped)  # once only
    assert len(closed) == 2


async def test_Sources_close_all_closes_every_unread_argument() -> None:
    closed: list[Any] = []
    sources = Sources(closed.append, expiry=0.0)
    for i in range(3):
        sources.add([i])
    sources.close_all()
    assert sorted(closed) == [[0], [1], [2]]
    assert len(sources) == 0


def _put(queue: SendQueue, item: Any) -> Future[None]:
    done: Future[None] = Future()
    queue.put(item, done)
    return done


async def test_SendQueue_put_waits_for_room_and_keeps_order() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=2)
    first, second, third = _put(queue, "a"), _put(queue, "b"), _put(queue, "c")
    assert first.done()
    assert second.done()
    assert not third.done()  # the queue is full: the sender waits
    assert queue.queued == 3
    async with asyncio.timeout(5):
        assert await queue.__anext__() == "a"
        assert third.done()  # room: the waiting item went in
        assert [await queue.__anext__(), await queue.__anext__()] == ["b", "c"]


async def test_SendQueue_take_now_hands_over_what_is_queued_as_anext_would() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=1)
    assert queue.take_now() is NOTHING  # nothing queued: the producer awaits __anext__
    first, second = _put(queue, "a"), _put(queue, "b")
    assert not second.done()
    assert queue.take_now() == "a"
    assert second.done()  # room: the waiting item went in, as with __anext__
    assert queue.take_now() == "b"
    queue.end()
    assert queue.take_now() is NOTHING  # the end is __anext__'s to say
    with pytest.raises(StopAsyncIteration):
        await queue.__anext__()
    assert first.done()


async def test_SendQueue_end_finishes_after_the_items_sent() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=4)
    _put(queue, 1)
    queue.end()
    with pytest.raises(ClosedError):
        _put(queue, 2).value()
    async with asyncio.timeout(5):
        assert [x async for x in queue] == [1]


async def test_SendQueue_the_producer_waits_for_an_item() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=4)
    taking = asyncio.ensure_future(queue.__anext__())
    await asyncio.sleep(0)
    assert not taking.done()
    _put(queue, "late")
    async with asyncio.timeout(5):
        assert await taking == "late"


async def test_SendQueue_stop_fails_waiting_sends_with_the_streams_error() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=1)
    _put(queue, "a")
    waiting = _put(queue, "b")
    lost = PeerLostError("w1")
    queue.why = lambda: lost
    await queue.aclose()  # the producer closes it: the stream is over
    with pytest.raises(PeerLostError):
        waiting.value()
    with pytest.raises(PeerLostError):
        _put(queue, "c").value()
    async with asyncio.timeout(5):
        assert [x async for x in queue] == []  # queued items are dropped


async def test_SendQueue_stop_without_a_failure_says_closed() -> None:
    queue = SendQueue(asyncio.get_running_loop(), limit=1)
    queue.stop()
    with pytest.raises(ClosedError):
        _put(queue, "a").value()


async def test_Sources_an_unclaimed_argument_expires_without_more_activity() -> None:
    loop = asyncio.get_running_loop()
    closed: list[Any] = []
    done = asyncio.Event()

    def close(items: Any) -> None:
        closed.append(items)
        done.set()

    def later(delay: float, sweep: Any) -> None:
        loop.call_soon_threadsafe(loop.call_later, delay, sweep)

    sources = Sources(close, expiry=0.05, later=later)
    sources.add(["lost request"])
    claimed = sources.add(["arrived"])
    sources.claim(claimed, peer=1)
    assert sources.unclaimed == 1
    async with asyncio.timeout(5):
        await done.wait()  # nothing else happens here: the scheduled sweep closes it
    assert closed == [["lost request"]]
    assert len(sources) == 1  # the claimed one waits for its reader
