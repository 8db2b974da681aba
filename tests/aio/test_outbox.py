"""In-process tests of the outbox and the dispatcher (``asyncrpc.runtime.calls``): no
network, no agent. The outbox writes to recording frames (the ``Frames`` port); replies
are fed back to it as decoded frames; the dispatcher serves requests from a stand-in
connection."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from asyncrpc.errors import ClosedError, PeerLostError, RpcTimeoutError
from asyncrpc.functions import inline
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import Frame, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import (
    Kind,
    Reply,
    Request,
    decode_message,
)
from asyncrpc.runtime.calls.deadline import running_until
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.outbox import Outbox
from asyncrpc.runtime.calls.pipeline import CallHook, CallKind, OutgoingCall, Pipeline
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Loop, OutgoingFrame
from asyncrpc.runtime.threads.pool import WorkerPool
from tests.fakes import NoProducers, NoRRefs
from tests.ordering import until_async

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


def _frames(pieces: list[Any]) -> list[Frame]:
    return FrameDecoder().feed(b"".join(bytes(p) for p in pieces))


class RecordingFrames:
    """The ``Frames`` port as the outbox uses it: records every frame, by destination."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Frame]] = []
        self.calls: list[Any] = []  # the call each frame belongs to (None: none)
        self.cancels: list[tuple[int, int]] = []

    def send(self, frame: OutgoingFrame) -> None:
        (decoded,) = _frames(frame.pieces)
        self.sent.append((frame.rank, decoded))
        self.calls.append(frame.call)

    def cancel(self, rank: int, call_id: int) -> None:
        self.cancels.append((rank, call_id))


def _outbox() -> tuple[Outbox, RecordingFrames]:
    loop = asyncio.get_running_loop()
    addresses = {0: PeerAddress("me", 0, "127.0.0.1", 1), 1: PeerAddress("w1", 1, "127.0.0.1", 2)}
    frames: Any = RecordingFrames()
    outbox = Outbox(
        "me", Loop(loop, WorkerPool(1, loop, "me")), serializer=Serializer(),
        pipeline=Pipeline(), directory=Directory(addresses, None), frames=frames,
        undelivered=lambda rank, forks: None, unlend=lambda keep: None, counters=Counters(),
        default_timeout=60.0,
    )  # fmt: skip
    return outbox, frames


def _reply(call_id: int, value: Any) -> Frame:
    payload, segments, _, _ = Serializer().dumps(value)
    (frame,) = _frames(encode_frame(Reply(call_id).to_fields(), payload, segments))
    return frame


async def test_Outbox_call_writes_one_request_and_its_reply_resolves_it() -> None:
    outbox, frames = _outbox()
    task = asyncio.create_task(outbox.call("w1", max, (1, 2), {}, -1))
    await asyncio.sleep(0)
    ((rank, frame),) = frames.sent
    request = decode_message(frame.fields)
    assert rank == 1
    assert isinstance(request, Request)
    assert request.timeout == 60.0  # the default, for a negative timeout
    reply = _reply(request.call_id, 2)
    outbox.on_reply(reply.fields, reply)
    assert await task == 2
    assert len(outbox) == 0


async def test_Outbox_timeout_fails_the_call_and_cancels_it_on_the_callee() -> None:
    outbox, frames = _outbox()
    future = outbox.call_future(1, max, (1, 2), {}, 0.05)
    with pytest.raises(RpcTimeoutError):
        await future
    ((_, frame),) = frames.sent
    assert frames.cancels == [(1, frame.fields[1])]


async def test_Outbox_cancelling_the_caller_cancels_the_call() -> None:
    outbox, frames = _outbox()
    task = asyncio.create_task(outbox.call("w1", max, (1, 2), {}, 0))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ((_, frame),) = frames.sent
    assert frames.cancels == [(1, frame.fields[1])]
    assert len(outbox) == 0


async def test_Outbox_lost_connection_fails_only_the_calls_written_on_it() -> None:
    outbox, frames = _outbox()
    first = asyncio.create_task(outbox.call("w1", max, (1, 2), {}, 0))
    second = asyncio.create_task(outbox.call("w1", max, (3, 4), {}, 0))
    await asyncio.sleep(0)
    conn = object()
    frames.calls[0].written(conn)  # the first call's request went out on conn
    outbox.fail_peer(1, PeerLostError("w1", "connection lost"), sent_on=conn)
    with pytest.raises(PeerLostError):
        await first
    assert not second.done()
    outbox.close()
    with pytest.raises(ClosedError):
        await second
    with pytest.raises(ClosedError):
        outbox.encode(1, max, (), {}, 0, CallKind.SYNC)


class HeldBack(CallHook):
    """A ready stage that holds the frames of calls to ``gpu_fn`` until a test says so
    (a CUDA tensor still being written by the GPU)."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Future[None]] = []

    def ready(self, call: OutgoingCall) -> Any:
        if call.fn is not _gpu_fn:
            return None
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        return gate


def _gpu_fn(x: int) -> int:
    return x


def _held_outbox() -> tuple[Outbox, RecordingFrames, HeldBack]:
    outbox, frames = _outbox()
    hook = HeldBack()
    outbox._pipeline = Pipeline([hook])
    return outbox, frames, hook


def _targets(frames: RecordingFrames) -> list[Any]:
    return [Serializer().loads(f.payload, f.segments)[1][0] for _, f in frames.sent]


async def test_Outbox_a_request_waiting_for_the_GPU_does_not_hold_back_other_threads() -> None:
    outbox, frames, hook = _held_outbox()
    held = outbox.call_future(1, _gpu_fn, (1,), {}, 0)  # this thread
    await until_async(lambda: len(hook.gates) == 1)
    other = await asyncio.to_thread(outbox.call_future, 1, max, (2, 0), {}, 0)  # another one
    await until_async(lambda: len(frames.sent) == 1)
    assert _targets(frames) == [2]  # went first
    hook.gates[0].set_result(None)
    await until_async(lambda: len(frames.sent) == 2)
    assert _targets(frames) == [2, 1]
    outbox.close()
    for future in (held, other):
        with pytest.raises(ClosedError):
            await future


async def test_Outbox_a_thread_s_later_requests_stay_behind_its_held_one() -> None:
    outbox, frames, hook = _held_outbox()
    outbox.call_future(1, _gpu_fn, (1,), {}, 0)
    outbox.call_future(1, max, (2, 0), {}, 0)  # same thread, same callee: keeps its order
    outbox.call_future(0, max, (3, 0), {}, 0)  # another callee: no order to keep
    await until_async(lambda: len(frames.sent) == 1)
    await asyncio.sleep(0.01)
    assert _targets(frames) == [3]
    hook.gates[0].set_result(None)
    await until_async(lambda: len(frames.sent) == 3)
    assert _targets(frames) == [3, 1, 2]
    outbox.close()


async def test_Outbox_a_held_request_whose_wait_failed_still_reaches_the_links() -> None:
    # The links fail its call with the error, as for any frame whose ready stage raised.
    outbox, frames, hook = _held_outbox()
    sent: list[OutgoingFrame] = []
    frames.send = sent.append  # type: ignore[method-assign]
    outbox.call_future(1, _gpu_fn, (1,), {}, 0)
    await until_async(lambda: len(hook.gates) == 1)
    hook.gates[0].set_exception(RuntimeError("copy failed"))
    await until_async(lambda: len(sent) == 1)
    (frame,) = sent
    assert frame.ready is not None
    with pytest.raises(RuntimeError, match="copy failed"):
        await frame.ready
    outbox.close()


async def test_Outbox_close_drops_the_requests_it_held() -> None:
    outbox, frames, hook = _held_outbox()
    future = outbox.call_future(1, _gpu_fn, (1,), {}, 0)
    await until_async(lambda: len(hook.gates) == 1)
    outbox.close()
    with pytest.raises(ClosedError):
        await future
    await asyncio.sleep(0.01)
    assert not hook.gates[0].done() or hook.gates[0].cancelled()
    assert frames.sent == []


class Caller:
    """The connection a request came on, as the dispatcher sees it."""

    def __init__(self) -> None:
        self.peer: int | None = 1
        self.peer_name: str | None = "w1"


async def _dispatcher() -> tuple[Dispatcher, list[tuple[Any, Frame]], WorkerPool]:
    loop = asyncio.get_running_loop()
    written: list[tuple[Any, Frame]] = []

    def write(conn: Any, pieces: list[Any], keep: object, forks: Any) -> None:
        (frame,) = _frames(pieces)
        written.append((conn, frame))

    pool = WorkerPool(1, loop, "me")
    dispatcher = Dispatcher(
        "me", Loop(loop, pool), Serializer(), write, Counters(), Pipeline(), NoRRefs(),
        NoProducers(), print_errors=False,
    )  # fmt: skip
    return dispatcher, written, pool


def _request(call_id: int, fn: Any, args: tuple[Any, ...]) -> tuple[Request, Any, Any]:
    payload, segments, _, _ = Serializer().dumps((fn, args, {}))
    (frame,) = _frames(encode_frame(Request(call_id, 0, 0, "fn", None, None).to_fields(),
                                    payload, segments))  # fmt: skip
    request = decode_message(frame.fields)
    assert isinstance(request, Request)
    return request, frame.payload, frame.segments


@inline
def _add(a: int, b: int) -> int:
    return a + b


async def _sleep_then(value: int) -> int:
    await asyncio.sleep(30)
    return value


async def test_Dispatcher_serves_an_inline_request_with_one_reply() -> None:
    dispatcher, written, pool = await _dispatcher()
    conn = Caller()
    dispatcher.on_request(conn, *_request(7, _add, (1, 2)))
    ((to, frame),) = written
    assert to is conn
    assert frame.fields[:2] == [Kind.REPLY, 7]
    assert Serializer().loads(frame.payload, frame.segments) == 3
    assert len(dispatcher) == 0
    pool.shutdown()


async def test_Dispatcher_lost_connection_cancels_the_requests_that_came_on_it() -> None:
    dispatcher, written, pool = await _dispatcher()
    conn, other = Caller(), Caller()
    dispatcher.on_request(conn, *_request(1, _sleep_then, (1,)))
    dispatcher.on_request(other, *_request(2, _sleep_then, (2,)))
    assert len(dispatcher) == 2
    dispatcher.cancel_connection(conn)
    assert len(dispatcher) == 1
    dispatcher.on_cancel(1, 2)  # the caller's Cancel
    assert len(dispatcher) == 0
    await asyncio.sleep(0)
    assert written == []  # nobody to reply to
    pool.shutdown()


# -- deadlines ---------------------------------------------------------------------------------

_RAN: list[int] = []


def _blocker(seconds: float) -> None:
    time.sleep(seconds)


def _mark(n: int) -> int:
    _RAN.append(n)
    return n


def _timed_request(call_id: int, fn: Any, args: tuple[Any, ...], timeout: float) -> Any:
    payload, segments, _, _ = Serializer().dumps((fn, args, {}))
    fields = Request(call_id, timeout, 0, "fn", None, None).to_fields()
    (frame,) = _frames(encode_frame(fields, payload, segments))
    request = decode_message(frame.fields)
    assert isinstance(request, Request)
    return request, frame.payload, frame.segments


async def test_Dispatcher_requests_queued_past_their_deadline_never_run() -> None:
    # One pool thread, busy: the requests behind it wait until their callers gave up.
    loop = asyncio.get_running_loop()
    written: list[Any] = []
    counters = Counters()
    pool = WorkerPool(1, loop, "me", max_threads=1)
    dispatcher = Dispatcher(
        "me", Loop(loop, pool), Serializer(),
        lambda conn, pieces, keep, forks: written.append(pieces), counters, Pipeline(),
        NoRRefs(), NoProducers(), print_errors=False,
    )  # fmt: skip
    _RAN.clear()
    conn = Caller()
    dispatcher.on_request(conn, *_timed_request(1, _blocker, (0.5,), 0))
    for n in range(200):
        dispatcher.on_request(conn, *_timed_request(2 + n, _mark, (n,), 0.05))
    await until_async(lambda: counters.calls_expired == 200, timeout=10)
    assert _RAN == []  # none of them ran
    # Each answered with the timeout error (what follows a reply must settle), then the
    # blocker's reply.
    await until_async(lambda: len(written) == 201)
    kinds = [_frames(pieces)[0].fields[0] for pieces in written]
    assert kinds.count(Kind.ERROR) == 200
    assert len(dispatcher) == 0
    pool.shutdown()


_SLOW: list[str] = []


async def _slow() -> None:
    try:
        await asyncio.sleep(30)
    finally:
        _SLOW.append("finally")


async def test_Dispatcher_an_async_def_is_cancelled_at_its_deadline() -> None:
    dispatcher, written, pool = await _dispatcher()
    _SLOW.clear()
    dispatcher.on_request(Caller(), *_timed_request(1, _slow, (), 0.1))
    await until_async(lambda: len(written) == 1, timeout=5)
    ((_, frame),) = written
    assert frame.fields[0] == Kind.ERROR
    assert _SLOW == ["finally"]  # its own cleanup ran
    assert len(dispatcher) == 0
    pool.shutdown()


async def test_Outbox_a_call_made_while_serving_inherits_the_rest_of_the_budget() -> None:
    for inherit in (True, False):
        outbox, frames = _outbox()
        outbox._inherit = inherit
        with running_until(time.monotonic() + 2.0):
            outbox.call_future(1, max, (1, 2), {}, 0)  # none of its own
            outbox.call_future(1, max, (1, 2), {}, 10.0)  # longer than what is left
        await until_async(lambda frames=frames: len(frames.sent) == 2)
        timeouts = [decode_message(f.fields).timeout for _, f in frames.sent]
        if inherit:
            assert all(1.5 < t <= 2.0 for t in timeouts), timeouts
        else:
            assert timeouts == [0.0, 10.0]
        outbox.close()
