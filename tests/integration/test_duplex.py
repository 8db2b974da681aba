"""Client streams (``stream_arg``) and bidirectional streams (``bidi``) between real worker
processes over 127.0.0.1 (the shared group: the pytest process is "driver", w1 and w3 are
synchronous workers, w2 an asyncio one). A caller's source runs in the caller, so what it
did is observed here; what a callee saw is asked of the callee."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

import asyncrpc
from tests.integration import duplex_fns as df
from tests.integration.conftest import Group
from tests.ordering import eventually

pytestmark = pytest.mark.timeout(90)


def _tag() -> str:
    return uuid.uuid4().hex


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    return eventually(condition, timeout, every=0.02)


def _no_streams_left(worker: str) -> bool:
    """No stream entry nor unread stream argument left on ``worker`` nor here."""

    def clean() -> bool:
        there = asyncrpc.rpc_sync(worker, asyncrpc.get_metrics)
        here = asyncrpc.get_metrics()
        return all(
            m[key] == 0
            for m in (here, there)
            for key in ("streams_producing", "streams_consuming", "stream_args_held")
        )

    return _eventually(clean)


# -- client streams --------------------------------------------------------------------------


def test_stream_arg_sync_and_async_callees_read_every_item_in_order(group: Group) -> None:
    n = 20_000
    assert asyncrpc.rpc_sync("w1", df.total, args=(asyncrpc.stream_arg(range(n)),)) == sum(range(n))
    assert asyncrpc.rpc_sync("w2", df.atotal, args=(asyncrpc.stream_arg(iter(range(n))),)) == sum(
        range(n)
    )
    tag = _tag()
    assert (
        asyncrpc.rpc_sync("w2", df.read_noted, args=(asyncrpc.stream_arg(range(500)), tag)) == 500
    )
    assert asyncrpc.rpc_sync("w2", df.seen, args=(tag,)) == list(range(500))
    assert _no_streams_left("w1")
    assert _no_streams_left("w2")


@pytest.mark.asyncio
async def test_stream_arg_from_an_async_generator_with_tensors(group: Group) -> None:
    async def source() -> Any:
        for i in range(100):
            yield torch.full((4,), float(i))

    async with asyncio.timeout(30):
        got = await asyncrpc.rpc_async("w3", df.tensor_sum, args=(asyncrpc.stream_arg(source()),))
    assert torch.equal(got, torch.full((4,), float(sum(range(100)))))


def test_stream_arg_between_workers_and_to_self(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", df.relay, args=("w3", 1000)) == sum(range(1000))
    assert asyncrpc.rpc_sync("driver", df.total, args=(asyncrpc.stream_arg(range(300)),)) == sum(
        range(300)
    )


def test_stream_arg_bad_input_is_refused_at_once(group: Group) -> None:
    with pytest.raises(TypeError):
        asyncrpc.stream_arg(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        asyncrpc.stream_arg(range(3), window=0)
    arg = asyncrpc.stream_arg(range(3))
    assert asyncrpc.rpc_sync("w1", df.total, args=(arg,)) == 3
    with pytest.raises(asyncrpc.StreamArgError):
        asyncrpc.rpc_sync("w1", df.total, args=(arg,))  # sent once


# -- client streams: errors, early ends, cancellation, timeouts ------------------------------


def test_stream_arg_source_error_reaches_the_callee_as_its_type(group: Group) -> None:
    # The source raises here; the callee's reading raises it, and its function, which
    # lets it through, fails the call with the same type.
    assert (
        asyncrpc.rpc_sync(
            "w1", df.error_type_of_reading, args=(asyncrpc.stream_arg(df.failing_source(5)),)
        )
        == "SourceError"
    )
    with pytest.raises(df.SourceError):
        asyncrpc.rpc_sync("w2", df.atotal, args=(asyncrpc.stream_arg(df.failing_source(5)),))
    assert _no_streams_left("w1")


@pytest.mark.parametrize("fn", [df.read_some, df.read_some_sync], ids=["async", "sync"])
def test_stream_arg_callee_reading_part_closes_the_source(group: Group, fn: object) -> None:
    tag = _tag()
    source = df.slow_source(tag, 1_000_000, 0.0)
    got = asyncrpc.rpc_sync("w2", fn, args=(asyncrpc.stream_arg(source, window=8), 10))
    assert got == list(range(10))
    assert _eventually(lambda: df.ENDED.get(tag) == "finally")  # the source's finally, here
    assert len(df.SEEN[tag]) <= 10 + 8 + 1  # never more than a window past what was read
    assert _no_streams_left("w2")


def test_stream_arg_callee_error_keeps_its_type_and_closes_the_source(group: Group) -> None:
    tag = _tag()
    with pytest.raises(df.ReaderError):
        asyncrpc.rpc_sync(
            "w2", df.read_then_fail, args=(asyncrpc.stream_arg(df.slow_source(tag, 10**6, 0.0)), 3)
        )
    assert _eventually(lambda: df.ENDED.get(tag) == "finally")
    assert _no_streams_left("w2")


@pytest.mark.asyncio
@pytest.mark.parametrize("source", [df.slow_source, df.aslow_source], ids=["sync", "async"])
async def test_stream_arg_cancelling_the_call_stops_both_ends(group: Group, source: Any) -> None:
    tag = _tag()
    fut = asyncrpc.rpc_async(
        "w2", df.read_slowly, args=(asyncrpc.stream_arg(source(tag, 10**6, 0.0)), tag)
    )
    assert await asyncio.to_thread(
        _eventually, lambda: asyncrpc.rpc_sync("w2", df.seen, args=(tag,))
    )
    fut.cancel()
    assert await asyncio.to_thread(
        _eventually, lambda: asyncrpc.rpc_sync("w2", df.ended, args=(tag,)) == "CancelledError"
    )
    assert await asyncio.to_thread(_eventually, lambda: df.ENDED.get(tag) == "finally")
    assert await asyncio.to_thread(_no_streams_left, "w2")


def test_stream_arg_callee_waits_for_an_item_at_most_its_timeout(group: Group) -> None:
    tag = _tag()
    slow = asyncrpc.stream_arg(df.slow_source(tag, 3, 2.0), timeout=0.5)
    assert asyncrpc.rpc_sync("w1", df.error_type_of_reading, args=(slow,)) == "RpcTimeoutError"
    assert _eventually(lambda: df.ENDED.get(tag) == "finally")
    assert _no_streams_left("w1")


def test_stream_arg_call_timeout_closes_the_callee_and_the_source(group: Group) -> None:
    tag, source_tag = _tag(), _tag()
    arg = asyncrpc.stream_arg(df.slow_source(source_tag, 10**6, 0.0))
    with pytest.raises(asyncrpc.RpcTimeoutError):
        asyncrpc.rpc_sync("w2", df.read_slowly, args=(arg, tag), timeout=1.5)
    assert _eventually(lambda: asyncrpc.rpc_sync("w2", df.ended, args=(tag,)) == "CancelledError")
    assert _eventually(lambda: df.ENDED.get(source_tag) == "finally")
    assert _no_streams_left("w2")


def test_stream_arg_through_an_rref_proxy(group: Group) -> None:
    rref = asyncrpc.remote("w1", df.Learner, args=(1,))
    assert rref.rpc_sync().add_all(asyncrpc.stream_arg(range(100))) == sum(range(100))


# -- bidirectional streams -------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("worker", "fn"), [("w2", df.doubler), ("w1", df.doubler_sync)], ids=["async", "sync"]
)
async def test_bidi_sends_and_replies_flow_at_once(group: Group, worker: str, fn: Any) -> None:
    n = 5000
    b = asyncrpc.bidi(worker, fn)

    async def send() -> None:
        for i in range(n):
            await b.send(i)
        b.done_sending()

    async with asyncio.timeout(60):
        sender = asyncio.ensure_future(send())
        got = [r async for r in b]
        await sender
    assert got == [2 * i for i in range(n)]
    assert await asyncio.to_thread(_no_streams_left, worker)


@pytest.mark.asyncio
async def test_bidi_ping_pong_one_request_one_reply(group: Group) -> None:
    async with asyncio.timeout(30), asyncrpc.rpc_bidi("w2", df.adder, args=(0.5,)) as b:
        for i in range(50):
            await b.send(torch.full((3,), float(i)))
            reply = await b.__anext__()
            assert torch.equal(reply, torch.full((3,), i + 0.5))
        b.done_sending()
        assert [r async for r in b] == [50]


def test_bidi_sync_forms_from_threads(group: Group) -> None:
    b = asyncrpc.bidi("w3", df.doubler_sync)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            for i in range(2000):
                b.send(i).wait(30)
            b.done_sending()
        except BaseException as exc:  # the main thread reports it
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    got = list(b)
    sender.join(30)
    assert not errors
    assert got == [2 * i for i in range(2000)]


def test_bidi_between_workers_on_an_agent_loop(group: Group) -> None:
    assert asyncrpc.rpc_sync("w2", df.arelay_bidi, args=("w1", 500)) == [2 * i for i in range(500)]


@pytest.mark.asyncio
async def test_bidi_callee_error_reaches_the_caller_and_ends_sending(group: Group) -> None:
    b = asyncrpc.bidi("w2", df.fail_after, 3)
    got = []
    async with asyncio.timeout(30):
        for i in range(4):  # the last one breaks it: no send races the failure
            await b.send(i)
        with pytest.raises(df.ReaderError):  # noqa: PT012 (the error ends the iteration)
            async for r in b:
                got.append(r)
        with pytest.raises(df.ReaderError):  # sending on a failed stream: its error
            await b.send(99)
    assert got == [0, 1, 2]


@pytest.mark.asyncio
async def test_bidi_caller_close_closes_the_callee_function(group: Group) -> None:
    tag = _tag()
    b = asyncrpc.bidi("w2", df.noted_doubler, tag)
    async with asyncio.timeout(30):
        await b.send(1)
        assert await b.__anext__() == 2
        b.close()
        with pytest.raises(asyncrpc.ClosedError):
            await b.send(2)
    assert await asyncio.to_thread(
        _eventually, lambda: asyncrpc.rpc_sync("w2", df.ended, args=(tag,)) is not None
    )
    assert await asyncio.to_thread(_no_streams_left, "w2")


@pytest.mark.asyncio
async def test_bidi_task_cancellation_closes_both_ends(group: Group) -> None:
    tag = _tag()
    b = asyncrpc.bidi("w2", df.noted_doubler, tag)

    async def consume() -> None:
        await b.send(1)
        async for _ in b:
            pass  # waits for replies that never come: no more requests

    task = asyncio.ensure_future(consume())
    assert await asyncio.to_thread(
        _eventually, lambda: asyncrpc.rpc_sync("w2", df.seen, args=(tag,)) == [1]
    )
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(asyncrpc.ClosedError):
        await asyncio.wait_for(b.send(2), 10)
    assert await asyncio.to_thread(
        _eventually, lambda: asyncrpc.rpc_sync("w2", df.ended, args=(tag,)) is not None
    )
    assert await asyncio.to_thread(_no_streams_left, "w2")


def test_bidi_total_timeout_closes_the_callee(group: Group) -> None:
    tag = _tag()
    b = asyncrpc.rpc_bidi("w2", df.waits_for_requests, args=(tag,), total_timeout=1.0)
    b.send(7).wait(10)
    with pytest.raises(asyncrpc.RpcTimeoutError):
        list(b)
    assert _eventually(lambda: asyncrpc.rpc_sync("w2", df.ended, args=(tag,)) == "closed")
    assert asyncrpc.rpc_sync("w2", df.seen, args=(tag,)) == [7]
    with pytest.raises(asyncrpc.RpcTimeoutError):  # sending on a failed stream: its error
        b.send(8).wait(10)
    assert _no_streams_left("w2")


def test_bidi_rref_proxy_runs_an_actor_method(group: Group) -> None:
    rref = asyncrpc.remote("w2", df.Learner, args=(10,))
    b = rref.bidi().train()
    replies = []
    for i in range(1, 6):
        b.send(i).wait(10)
        replies.append(next(b))
    b.done_sending()
    assert list(b) == []
    assert replies == [10, 30, 60, 100, 150]


def test_stream_arg_never_read_is_released_and_its_source_closed(group: Group) -> None:
    tag = _tag()
    source = df.slow_source(tag, 10**6, 0.0)
    arg = asyncrpc.stream_arg(source, window=4)
    assert asyncrpc.rpc_sync("w2", df.ignores, args=(arg,)) == "StreamInput"
    # Closed here, at once (a generator closed before its first step runs no finally).
    assert _eventually(lambda: inspect.getgeneratorstate(source) == inspect.GEN_CLOSED)
    assert len(df.SEEN.get(tag, ())) <= 4 + 1  # within its first credit, if advanced at all
    assert _no_streams_left("w2")


def test_stream_arg_passed_on_unread_is_read_by_the_next_callee(group: Group) -> None:
    arg = asyncrpc.stream_arg(range(1000))
    assert asyncrpc.rpc_sync("w1", df.forwards, args=(arg, "w3")) == sum(range(1000))
    assert _no_streams_left("w3")


# -- gradients through streams (issue 36, item 3) --------------------------------------------


@pytest.mark.parametrize("fn", [df.scaled, df.ascaled], ids=["sync", "async"])
def test_stream_items_carry_gradients_back_to_the_producer(group: Group, fn: Any) -> None:
    from asyncrpc import autograd as dist_autograd

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with dist_autograd.context() as ctx:
        items = list(asyncrpc.stream("w1" if fn is df.scaled else "w2", fn, x, 3))
        assert all(item.requires_grad for item in items)
        loss = torch.stack(items).sum()
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
    assert torch.equal(grads[x], torch.full((2,), 1.0 + 2.0 + 3.0))


def test_stream_arg_items_carry_gradients_back_to_the_sender(group: Group) -> None:
    from asyncrpc import autograd as dist_autograd

    x = torch.tensor([1.0, -1.0], requires_grad=True)
    with dist_autograd.context() as ctx:
        items = [x * k for k in range(1, 5)]
        total = asyncrpc.rpc_sync("w1", df.summed, args=(asyncrpc.stream_arg(items),))
        assert total.requires_grad
        dist_autograd.backward(ctx, [(total * total).sum()])
        grads = dist_autograd.get_gradients(ctx)
    # total = 10 x, loss = sum(100 x^2): d/dx = 200 x
    assert torch.allclose(grads[x], 200 * x.detach())


@pytest.mark.asyncio
async def test_bidi_gradients_flow_through_requests_and_replies(group: Group) -> None:
    from asyncrpc import autograd as dist_autograd

    x = torch.tensor([0.5, 2.0], requires_grad=True)
    async with asyncio.timeout(30), dist_autograd.context() as ctx:
        b = asyncrpc.bidi("w2", df.tripled)
        replies = []
        for k in range(1, 4):
            await b.send(x * k)
            replies.append(await b.__anext__())
        b.done_sending()
        assert [r async for r in b] == []
        loss = torch.stack(replies).sum()
        await dist_autograd.backward_async(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
    assert torch.equal(grads[x], torch.full((2,), 3.0 * (1 + 2 + 3)))


# -- flow control both ways -------------------------------------------------------------------


def test_stream_arg_stalled_callee_stops_the_source_at_the_window(group: Group) -> None:
    tag, source_tag = _tag(), _tag()
    arg = asyncrpc.stream_arg(df.slow_source(source_tag, 10**6, 0.0), window=8)
    call = asyncrpc.rpc_async("w2", df.read_slowly, args=(arg, tag))  # one item a second
    assert _eventually(lambda: asyncrpc.rpc_sync("w2", df.seen, args=(tag,)) == [0])
    time.sleep(0.5)  # the source has had time to run ahead, if it could
    assert len(df.SEEN[source_tag]) <= 1 + 8 + 1  # read, the window, one being made
    call.cancel()
    assert _eventually(lambda: df.ENDED.get(source_tag) == "finally")
    assert _no_streams_left("w2")


@pytest.mark.asyncio
async def test_bidi_sends_wait_while_the_callee_does_not_read(group: Group) -> None:
    tag, window = _tag(), 4
    b = asyncrpc.rpc_bidi("w2", df.never_reads, args=(tag,), window=window)
    sends = [b.send(i) for i in range(30)]
    await asyncio.sleep(1.0)
    queued = sum(s.done() for s in sends)
    # The callee's credit (a window) and the sender's queue (a window): no more.
    assert window <= queued <= 2 * window + 1, queued
    assert await asyncio.to_thread(asyncrpc.rpc_sync, "w2", df.release, args=(tag,))
    async with asyncio.timeout(30):
        replies = [await b.__anext__() for _ in range(30)]  # it reads: every send goes
        assert all(s.done() for s in sends)
        b.done_sending()
        assert [r async for r in b] == []
    assert replies == list(range(30))


def test_stream_arg_byte_window_bounds_the_callers_source(group: Group) -> None:
    # As test_streams' byte-window test, the other way: 4 MiB tensors, a 16 MiB window;
    # the callee takes one and stalls: the caller's source makes at most a window more.
    tag, size, n = _tag(), 4 << 20, 12
    arg = asyncrpc.stream_arg(df.blobs(tag, n, size), window_bytes=16 << 20)
    call = asyncrpc.rpc_async("w2", df.held_then_read, args=(arg, tag))
    assert _eventually(lambda: len(df.SEEN.get(tag, ())) >= 4)
    time.sleep(0.3)  # nothing more may be made while the callee holds; more would fail
    # 16 MiB made, one item of it taken: credit comes back at half the byte window.
    assert len(df.SEEN[tag]) == 4, df.SEEN[tag]
    assert asyncrpc.rpc_sync("w2", df.release, args=(tag,))
    assert call.wait(30) == n
    assert _no_streams_left("w2")
