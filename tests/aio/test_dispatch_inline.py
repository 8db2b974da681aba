"""The dispatcher and ``@inline @async_execution`` functions: a future they return done is
replied to at once, with no task and no loop turn in between; others when they complete."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.functions import async_execution, inline
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import CallMode, Kind, Request, decode_message
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.pipeline import Pipeline
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Loop
from asyncrpc.runtime.threads.pool import WorkerPool
from tests.fakes import NoProducers, NoRRefs

pytestmark = pytest.mark.timeout(30)

LATER: list[Future[int]] = []


@inline
@async_execution
def done_already(value: int) -> Future[int]:
    done: Future[int] = Future()
    done.set_result(value)
    return done


@inline
@async_execution
def done_later() -> Future[int]:
    later: Future[int] = Future()
    LATER.append(later)
    return later


@inline
@async_execution
def failed_already() -> Future[int]:
    failed: Future[int] = Future()
    failed.set_exception(KeyError("no"))
    return failed


class Caller:
    def __init__(self) -> None:
        self.peer: int | None = 1
        self.peer_name: str | None = "w1"


def _request(call_id: int, fn: Any, args: tuple[Any, ...]) -> Any:
    payload, segments, _, _ = Serializer().dumps((fn, args, {}))
    fields = Request(call_id, 0, CallMode.CALL, "fn", None, None, None).to_fields()
    pieces = encode_frame(fields, payload, segments)
    (frame,) = FrameDecoder().feed(b"".join(bytes(p) for p in pieces))
    return decode_message(frame.fields), frame.payload, frame.segments


def _dispatcher() -> tuple[Dispatcher, list[Frame], WorkerPool]:
    loop = asyncio.get_running_loop()
    written: list[Frame] = []
    workers = WorkerPool(1, loop, "me")

    def write(conn: Any, pieces: list[Any], keep: object, forks: Any) -> None:
        written.extend(FrameDecoder().feed(b"".join(bytes(p) for p in pieces)))

    dispatcher = Dispatcher(
        "me", Loop(loop, workers), Serializer(), write, Counters(), Pipeline([]), NoRRefs(),
        NoProducers(), print_errors=False,
    )  # fmt: skip
    return dispatcher, written, workers


@pytest.mark.asyncio
async def test_Dispatcher_replies_at_once_to_an_inline_future_done_already() -> None:
    dispatcher, written, workers = _dispatcher()
    dispatcher.on_request(Caller(), *_request(5, done_already, (42,)))
    # No await in between: the reply went out within on_request.
    assert [f.fields[:2] for f in written] == [[Kind.REPLY, 5]]
    assert Serializer().loads(written[0].payload, written[0].segments) == 42
    assert len(dispatcher) == 0
    workers.shutdown()


@pytest.mark.asyncio
async def test_Dispatcher_replies_to_other_inline_futures_when_they_complete() -> None:
    dispatcher, written, workers = _dispatcher()
    LATER.clear()
    dispatcher.on_request(Caller(), *_request(6, done_later, ()))
    dispatcher.on_request(Caller(), *_request(7, failed_already, ()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert [f.fields[:2] for f in written] == [[Kind.ERROR, 7]]
    assert isinstance(unpack_exception(bytes(written[0].payload)), KeyError)
    assert len(dispatcher) == 1  # still running: cancellable
    LATER[0].set_result(3)
    for _ in range(100):  # bounded: the completion reaches the loop
        if len(written) == 2:
            break
        await asyncio.sleep(0.01)
    assert written[1].fields[:2] == [Kind.REPLY, 6]
    assert Serializer().loads(written[1].payload, written[1].segments) == 3
    workers.shutdown()
