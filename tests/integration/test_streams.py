"""Streaming calls between real worker processes over 127.0.0.1 (the shared group).

The pytest process is the consumer ("driver"); w1 and w3 are synchronous workers, w2 an
asyncio one. What ran on a callee (how far a generator got, whether its ``finally`` ran)
is asked of the callee itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from torch.profiler import profile

import asyncrpc
from asyncrpc.profiling import remote_event_name, rpc_span_name
from asyncrpc.profiling.names import stream_items_name
from tests.integration import stream_fns as sf
from tests.integration.conftest import Group
from tests.ordering import eventually

pytestmark = pytest.mark.timeout(90)


def _tag() -> str:
    return uuid.uuid4().hex


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``condition`` (cross-process effects land asynchronously); bounded."""
    return eventually(condition, timeout, every=0.02)


def _no_streams_left(worker: str) -> bool:
    """No stream entry left on ``worker`` nor here, and no busy pool thread there."""

    def clean() -> bool:
        there = asyncrpc.rpc_sync(worker, sf.stream_metrics)
        here = asyncrpc.get_metrics()
        return (
            there["streams_producing"] == 0
            and there["streams_consuming"] == 0
            and here["streams_consuming"] == 0
            and there["thread_pool_busy"] == 0
        )

    return _eventually(clean)


# -- order, count, kinds of producer -----------------------------------------------------


@pytest.mark.asyncio
async def test_stream_delivers_100k_items_in_order_exactly_once(group: Group) -> None:
    async with asyncio.timeout(60):
        items = [x async for x in asyncrpc.stream("w1", sf.count, 100_000)]
    assert items == list(range(100_000))
    assert _no_streams_left("w1")


@pytest.mark.asyncio
async def test_stream_from_an_async_generator_on_an_asyncio_worker(group: Group) -> None:
    async with asyncio.timeout(60):
        items = [x async for x in asyncrpc.stream("w2", sf.acount, 20_000)]
    assert items == list(range(20_000))
    assert _no_streams_left("w2")


def test_stream_sync_consumer_with_for(group: Group) -> None:
    assert list(asyncrpc.rpc_stream("w3", sf.count, args=(1000,), window=7)) == list(range(1000))
    assert list(asyncrpc.stream("w3", sf.returns_iterator, 5)) == ["0", "1", "2", "3", "4"]
    assert list(asyncrpc.stream("w3", sf.count, 0)) == []


def test_stream_consumers_on_workers_sync_and_on_the_agent_loop(group: Group) -> None:
    # w1 consumes from w3 on a pool thread (for); w2 consumes on its agent's own loop.
    assert asyncrpc.rpc_sync("w1", sf.consume, args=("w3", 500)) == list(range(500))
    assert asyncrpc.rpc_sync("w2", sf.aconsume, args=("w1", 500)) == list(range(500))
    # A `for` on the agent's loop thread would deadlock it: refused with a typed error.
    assert asyncrpc.rpc_sync("w1", sf.iterate_on_loop, args=("w3",)) == "BlockingCallError"
    assert _no_streams_left("w1")
    assert _no_streams_left("w3")


def test_stream_to_self_goes_through_the_loopback(group: Group) -> None:
    assert list(asyncrpc.stream("driver", sf.count, 300)) == list(range(300))


def test_stream_of_a_non_iterable_fails_with_type_error(group: Group) -> None:
    with pytest.raises(TypeError):
        list(asyncrpc.stream("w1", sf.not_a_generator))
    with pytest.raises(ValueError, match="window"):
        asyncrpc.rpc_stream("w1", sf.count, args=(3,), window=0)


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("fn", [sf.failing, sf.afailing], ids=["sync", "async"])
async def test_stream_producer_error_reaches_consumer_after_prior_items(
    group: Group, fn: Callable[[int], object]
) -> None:
    got: list[int] = []

    async def consume() -> None:
        async for x in asyncrpc.stream("w1", fn, 50):
            got.append(x)

    async with asyncio.timeout(30):
        with pytest.raises(sf.ProducerError) as info:
            await consume()
    assert got == list(range(50))
    assert info.value.after == 50
    assert _no_streams_left("w1")


def test_stream_producer_error_in_a_sync_consumer(group: Group) -> None:
    stream = asyncrpc.stream("w2", sf.failing, 3)
    assert [next(stream), next(stream), next(stream)] == [0, 1, 2]
    with pytest.raises(sf.ProducerError):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)  # after the error: ended


# -- cancellation both ways ----------------------------------------------------------------


@pytest.mark.parametrize("fn", [sf.tracked, sf.atracked], ids=["sync", "async"])
def test_stream_early_break_runs_the_producer_finally(group: Group, fn: object) -> None:
    tag = _tag()
    for x in asyncrpc.stream("w1", fn, tag):  # type: ignore[arg-type]
        if x == 10:
            break  # drops the stream: its close stops the (endless) producer
    assert _eventually(lambda: asyncrpc.rpc_sync("w1", sf.finally_count, args=(tag,)) == 1)
    assert _no_streams_left("w1")


@pytest.mark.asyncio
async def test_stream_async_with_closes_the_producer(group: Group) -> None:
    tag = _tag()
    async with asyncio.timeout(30), asyncrpc.stream("w2", sf.atracked, tag) as stream:
        async for x in stream:
            if x == 3:
                break
    assert _eventually(lambda: asyncrpc.rpc_sync("w2", sf.finally_count, args=(tag,)) == 1)
    assert _no_streams_left("w2")


@pytest.mark.asyncio
@pytest.mark.parametrize("fn", [sf.tracked, sf.atracked], ids=["sync", "async"])
async def test_stream_task_cancellation_runs_the_producer_finally(group: Group, fn: object) -> None:
    tag = _tag()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in asyncrpc.stream("w1", fn, tag, None, 0.2):  # type: ignore[arg-type]
            started.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(30):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _eventually(lambda: asyncrpc.rpc_sync("w1", sf.finally_count, args=(tag,)) == 1)
    assert _no_streams_left("w1")


def test_stream_item_timeout_raises_and_stops_the_producer(group: Group) -> None:
    tag = _tag()
    stream = asyncrpc.rpc_stream("w2", sf.atracked, args=(tag, None, 30.0), timeout=0.5)
    assert next(stream) == 0
    with pytest.raises(asyncrpc.RpcTimeoutError):
        next(stream)  # the next item comes after 30 s
    assert _eventually(lambda: asyncrpc.rpc_sync("w2", sf.finally_count, args=(tag,)) == 1)
    assert _no_streams_left("w2")


# -- deadlines: the whole stream's limit, and a served request's deadline --------------------


@pytest.mark.parametrize("fn", [sf.tracked, sf.atracked], ids=["sync", "async"])
def test_stream_total_timeout_closes_the_producer_and_raises_after_the_items(
    group: Group, fn: object
) -> None:
    tag = _tag()
    stream = asyncrpc.rpc_stream("w1", fn, args=(tag, None, 0.05), total_timeout=0.5)
    received: list[int] = []

    def take_all() -> None:
        for item in stream:  # endless, an item every 50 ms: only the limit ends it
            received.append(item)

    started = time.monotonic()
    with pytest.raises(asyncrpc.RpcTimeoutError):
        take_all()
    elapsed = time.monotonic() - started
    assert received == list(range(len(received)))
    assert len(received) >= 1
    assert 0.45 <= elapsed < 5.0, elapsed  # not before the limit; bounded for a loaded VM
    assert _eventually(lambda: asyncrpc.rpc_sync("w1", sf.finally_count, args=(tag,)) == 1)
    assert _no_streams_left("w1")


@pytest.mark.parametrize("fn", [sf.remaining_items, sf.aremaining_items], ids=["sync", "async"])
def test_stream_producer_reads_its_time_remaining(group: Group, fn: object) -> None:
    got = list(asyncrpc.rpc_stream("w1", fn, args=(3,), total_timeout=5.0))
    assert len(got) == 3, got
    assert all(r is not None and 0.0 < r <= 5.0 for r in got), got
    assert got[0] > 4.0, got  # the budget less one trip, not some other figure
    assert list(asyncrpc.rpc_stream("w1", fn, args=(1,))) == [None]  # no limit: None


def test_stream_opened_inside_a_served_call_ends_at_that_calls_deadline(group: Group) -> None:
    # The driver gives w3 one second; w3 consumes an endless stream from w1 (opened with
    # no limit of its own): the stream inherits w3's deadline, so w1's generator is closed
    # then, not when w3's consumer happens to notice.
    tag = _tag()
    started = time.monotonic()
    with pytest.raises(asyncrpc.RpcTimeoutError):
        asyncrpc.rpc_sync("w3", sf.consume_forever, args=("w1", tag), timeout=1.0)
    assert time.monotonic() - started < 5.0
    assert _eventually(lambda: asyncrpc.rpc_sync("w1", sf.finally_count, args=(tag,)) == 1)
    assert _eventually(lambda: asyncrpc.rpc_sync("w1", sf.produced, args=(tag,)) > 0)
    assert _no_streams_left("w1")


# -- flow control ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [sf.tracked, sf.atracked], ids=["sync", "async"])
def test_stream_slow_consumer_bounds_the_producer_by_the_window(group: Group, fn: object) -> None:
    tag, window = _tag(), 4
    ahead: list[int] = []
    stream = asyncrpc.rpc_stream("w1", fn, args=(tag, 40), window=window)
    for consumed, _ in enumerate(stream, start=1):
        time.sleep(0.02)  # a slow consumer: the producer could run far ahead without credit
        made = asyncrpc.rpc_sync("w1", sf.produced, args=(tag,))
        ahead.append(made - consumed)
    assert len(ahead) == 40
    assert max(ahead) <= window, ahead
    assert max(ahead) >= 1, ahead  # it did run ahead while the consumer slept


def test_stream_stalled_consumer_stops_the_producer_at_the_window(group: Group) -> None:
    tag, window = _tag(), 16
    with asyncrpc.rpc_stream("w3", sf.tracked, args=(tag,), window=window) as stream:
        assert next(stream) == 0
        # The consumer stalls with one item taken: the producer stops within the window.
        assert _eventually(lambda: asyncrpc.rpc_sync("w3", sf.produced, args=(tag,)) >= window)
        # Left as a sleep: nothing more may be produced, and no event marks the producer
        # parked for credit on w3 (inside the runtime). Overproduction would fail it.
        time.sleep(0.3)
        assert asyncrpc.rpc_sync("w3", sf.produced, args=(tag,)) <= window + 1
    assert _eventually(lambda: asyncrpc.rpc_sync("w3", sf.finally_count, args=(tag,)) == 1)


@pytest.mark.parametrize("fn", [sf.blobs, sf.ablobs], ids=["sync", "async"])
def test_stream_byte_window_bounds_large_items_by_the_producers_count(
    group: Group, fn: object
) -> None:
    # The 64 MiB items in a 256 MiB byte window, scaled down to stay light on a
    # shared machine: 4 MiB tensors in 16 MiB. The item window (128) would let all 12 go;
    # the bytes stop the producer at 4 items made and not consumed, by its own count.
    tag, size, n = _tag(), 4 << 20, 12

    def made() -> int:
        return int(asyncrpc.rpc_sync("w1", sf.produced, args=(tag,)))

    with asyncrpc.rpc_stream("w1", fn, args=(tag, n, size), window_bytes=16 << 20) as stream:
        assert _eventually(lambda: made() >= 4)
        # Left as a sleep: nothing more may be made while nothing is consumed, and no
        # event marks the producer parked for credit. Overproduction would fail it.
        time.sleep(0.3)
        ahead = [made()]
        for consumed, tensor in enumerate(stream, start=1):
            assert tensor.shape == (size,)
            assert int(tensor[-1]) == consumed - 1
            del tensor
            time.sleep(0.02)  # a slow consumer: the producer refills its window meanwhile
            ahead.append(made() - consumed)
    assert len(ahead) == n + 1
    assert ahead[0] == 4, ahead
    assert max(ahead) <= 4, ahead


@pytest.mark.asyncio
async def test_stream_item_larger_than_the_byte_window_goes_alone(group: Group) -> None:
    tag, size = _tag(), 4 << 20
    ahead: list[int] = []
    async with asyncio.timeout(60):
        stream = asyncrpc.rpc_stream("w2", sf.ablobs, args=(tag, 5, size), window_bytes=1 << 20)
        async for consumed, tensor in _aenumerate(stream):
            assert tensor.shape == (size,)
            assert int(tensor[0]) == consumed - 1
            await asyncio.sleep(0.02)
            made = await asyncrpc.rpc_async("w2", sf.produced, args=(tag,))
            ahead.append(made - consumed)
    assert len(ahead) == 5
    assert max(ahead) <= 1, ahead  # each item alone: none made before its elder was taken
    with pytest.raises(ValueError, match="window_bytes"):
        asyncrpc.rpc_stream("w1", sf.count, args=(3,), window_bytes=-1)


async def _aenumerate(stream: asyncrpc.Stream[Any]) -> AsyncIterator[tuple[int, Any]]:
    consumed = 0
    async for item in stream:
        consumed += 1
        yield consumed, item


@pytest.mark.asyncio
async def test_stream_many_concurrent_streams_between_two_workers(group: Group) -> None:
    async def one(i: int) -> list[int]:
        fn = sf.count if i % 2 else sf.acount
        return [x async for x in asyncrpc.rpc_stream("w2", fn, args=(500 + i,), window=8)]

    async with asyncio.timeout(60):
        results = await asyncio.gather(*(one(i) for i in range(40)))
    assert results == [list(range(500 + i)) for i in range(40)]
    assert _no_streams_left("w2")


# -- RRef proxies, tensors -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stream_rref_proxy_iterates_a_generator_method(group: Group) -> None:
    rref = asyncrpc.remote("w1", sf.Counter, args=(100,))
    assert list(rref.stream().up(5)) == [100, 101, 102, 103, 104]
    async with asyncio.timeout(30):
        items = [x async for x in rref.stream(window=2).aup(6)]
    assert items == list(range(100, 106))
    # A byte window of one byte: every item goes alone, and the stream still finishes.
    assert list(rref.stream(window_bytes=1).up(3)) == [100, 101, 102]


def test_stream_of_tensors_intact_and_through_shared_memory(group: Group) -> None:
    floats = 1 << 18  # 1 MiB each: above the shared-memory threshold
    before = asyncrpc.get_metrics()["shm_segments_received"]
    # w1, not w3: the shared group keeps w3 on sockets (test_tensors_remote counts its bytes).
    for i, tensor in enumerate(asyncrpc.stream("w1", sf.tensors, 20, floats)):
        assert torch.equal(tensor, torch.full((floats,), float(i)))
    # Workers on one host share memory once they probed each other (the first segments
    # may go over the socket meanwhile).
    assert _eventually(
        lambda: (
            sum(t.numel() for t in asyncrpc.stream("w1", sf.tensors, 4, floats)) == 4 * floats
            and asyncrpc.get_metrics()["shm_segments_received"] > before
        )
    )
    assert _no_streams_left("w1")


# -- the call pipeline -------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [sf.count, sf.acount], ids=["sync", "async"])
def test_stream_profiler_shows_one_span_per_stream_with_its_item_count(
    group: Group, fn: Callable[[int], object]
) -> None:
    with profile() as prof:
        assert list(asyncrpc.stream("w1", fn, 25)) == list(range(25))
        assert list(asyncrpc.stream("w1", fn, 3)) == [0, 1, 2]
    found = {e.key: e.count for e in prof.key_averages()}
    span = rpc_span_name("stream", fn.__name__, "driver", "w1")
    assert found[span] == 2
    assert found[remote_event_name(span, stream_items_name(25))] == 1
    assert found[remote_event_name(span, stream_items_name(3))] == 1


def test_stream_inside_dist_autograd_items_keep_requires_grad(group: Group) -> None:
    # Distributed autograd follows stream items (tests/integration/test_duplex.py has the
    # gradients): inside a context they arrive requiring grad; outside one, as before.
    from asyncrpc import autograd as dist_autograd

    with dist_autograd.context():
        inside = list(asyncrpc.stream("w1", sf.grad_items, 3))
    assert [t.requires_grad for t in inside] == [True, True, True]
    outside = list(asyncrpc.stream("w1", sf.grad_items, 2))
    assert [t.tolist() for t in outside] == [[0.0, 0.0], [1.0, 1.0]]
