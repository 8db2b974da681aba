"""CUDA tensors in stream items take a call's path, on FakeDevices: staged on the copy-out
streams after the producer's work under the reply's map (a stream argument's: the sender's
own map), each item's frame held by the send gate until its copies ran, never a host wait,
items in order even when a later item's copy finishes first; on the consumer each item's
segments are copied in on the copy-in streams and its reader's current streams wait for
them on the reader's thread. Through the hook, the pipeline, the real producers and the
real dispatcher."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import CallMode, Request, decode_message
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.pipeline import IncomingCall, Pipeline, stream_source
from asyncrpc.runtime.calls.streams.consumer import Arrived, ConsumerStream
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.fake import FakeStream
from asyncrpc.runtime.cuda.items import ItemArrivals, ItemCopies
from asyncrpc.runtime.cuda.maps import FIELD, DeviceMapHook, HostCopy, HostTransfer
from asyncrpc.runtime.cuda.staging import StagedTransfer
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Loop
from asyncrpc.runtime.threads.pool import WorkerPool
from tests.aio.test_streams import Conn, Host
from tests.aio.test_streams import Hub as ConsumerHub
from tests.fakes import NoRRefs, settled

pytestmark = pytest.mark.timeout(20)

BACK = {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}  # the reply's map a caller sends


def setup() -> tuple[FakeDevices, StagedTransfer, Pipeline]:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu)
    return gpu, transfer, Pipeline([DeviceMapHook(None, transfer)])


def stream_call(pipeline: Pipeline, headers: dict[str, Any] | None = None) -> IncomingCall:
    call = IncomingCall(
        "w0", 0, "w1", 7, "m.gen", False, {FIELD: dict(BACK)} if headers is None else headers
    )
    pipeline.receiving(call)
    return call


def labels(stream: FakeStream) -> list[str]:
    return [item.label for item in stream.items]


def test_items_are_staged_on_the_copy_stream_after_the_producers_work_under_the_reply_map() -> None:
    gpu, transfer, pipeline = setup()
    call = stream_call(pipeline)
    policy = pipeline.item_policy(call)
    assert isinstance(policy, ItemCopies)  # not the blocking host copy
    kernel = gpu.launch(gpu.current_stream(0), "makes item 0")
    target, host = policy.to_host(FakeTensor(0, b"abcd", nbytes=4))
    assert target == "cuda:1"  # the reply's map
    assert isinstance(host, FakeTensor)
    assert host.fake_device is None
    out = transfer.out_stream(0)
    assert labels(out) == ["wait for default0", "copy 0:4 to host on " + out.name]
    ready = pipeline.items_ready(call)
    assert ready is not None
    assert ready()[0] is not None  # the copy has not run: the frame waits
    assert ready() == (None, 0)  # the next item starts afresh: nothing staged
    assert not kernel.done
    assert transfer.staged_out == 1


@pytest.mark.asyncio
async def test_each_item_waits_for_its_own_copies_only() -> None:
    gpu, transfer, pipeline = setup()
    call = stream_call(pipeline)
    policy = pipeline.item_policy(call)
    assert policy is not None
    ready = pipeline.items_ready(call)
    assert ready is not None
    policy.to_host(FakeTensor(0, b"aa", nbytes=2))
    first, _ = ready()
    policy.to_host(FakeTensor(1, b"bb", nbytes=2))
    second, _ = ready()
    assert first is not None
    assert second is not None
    gpu.run(transfer.out_stream(1))  # item 1's copy only
    async with asyncio.timeout(5):
        await second  # its frame waits for nothing of item 0's
    assert not await settled(first)
    gpu.run(transfer.out_stream(0))
    assert await settled(first)


def test_an_unmapped_device_is_refused_with_its_name() -> None:
    _, _, pipeline = setup()
    call = stream_call(pipeline, {FIELD: {"cuda:1": "cuda:0"}})
    policy = pipeline.item_policy(call)
    assert policy is not None
    with pytest.raises(SerializationError, match="cuda:0"):
        policy.to_host(FakeTensor(0, b"x", nbytes=1))


def test_a_stream_argument_follows_the_senders_own_map_to_its_reader() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu)
    pipeline = Pipeline([DeviceMapHook({"w0": {"cuda:0": "cuda:1"}}, transfer)])
    call = stream_call(pipeline, {})  # the reader (w0) opened it with no field of ours
    call.own_items = True
    policy = pipeline.item_policy(call)
    assert isinstance(policy, ItemCopies)
    assert policy.to_host(FakeTensor(0, b"x", nbytes=1))[0] == "cuda:1"
    ready = pipeline.items_ready(call)
    assert ready is not None
    assert ready()[0] is not None


def test_without_a_gpu_items_keep_the_host_copy() -> None:
    pipeline = Pipeline([DeviceMapHook(None, HostTransfer())])
    call = stream_call(pipeline)
    assert isinstance(pipeline.item_policy(call), HostCopy)
    assert pipeline.items_in(1) is None  # the default copy on receipt
    assert pipeline.items_ready(call) is None  # its items never wait


# -- the producer: frames held in order, never a host wait ------------------------------------


def _dumps(serializer: Serializer, policy: Any, item: Any) -> Any:
    """What pickling an item does to its CUDA tensors (a FakeTensor is no torch tensor:
    the serializer would not ask the policy, so the test asks it, as export_tensor does)."""
    tensors = item if isinstance(item, list) else [item]
    labels = [policy.to_host(t)[0] for t in tensors]
    return serializer.dumps([t.value for t in tensors] + labels)


async def _ticking(ticks: list[int]) -> None:
    while True:  # the loop goes on while frames are held: nothing blocks it
        ticks.append(1)
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_Producers_hold_each_item_until_its_copies_ran_and_keep_the_order(sync: bool) -> None:
    gpu, transfer, pipeline = setup()
    call = stream_call(pipeline)
    policy = pipeline.item_policy(call)
    items = [FakeTensor(0, b"i0", nbytes=2), FakeTensor(1, b"i1", nbytes=2), 2]

    def gen() -> Iterator[Any]:
        for item in items:
            yield item if isinstance(item, FakeTensor) else FakeTensor(None, item)

    async def agen() -> Any:
        for item in gen():
            yield item

    def dumps(item: Any) -> Any:
        if item.fake_device is None:
            return host.serializer.dumps(item.value)
        return _dumps(host.serializer, policy, item)

    fn = gen if sync else agen
    host = Host()
    producers, conn = host.producers(), Conn(host.serializer)
    producers.expect(conn, 2, 7, "gen")
    ready = pipeline.items_ready(call)
    producers.start(2, 7, fn, fn, (), {}, lambda ok, v: None, dumps, None, ready)
    ticks: list[int] = []
    ticker = asyncio.ensure_future(_ticking(ticks))
    producers.on_credit(2, 7, 10)
    await asyncio.sleep(0.05)
    assert conn.items == []  # item 0's copy has not run: nothing leaves, not even item 2
    gpu.run(transfer.out_stream(1))  # item 1's copy is done first
    await asyncio.sleep(0.05)
    assert conn.items == []  # still behind item 0
    assert len(ticks) > 10  # the loop ran all along (no host wait)
    gpu.run(transfer.out_stream(0))
    async with asyncio.timeout(5):
        await conn.done.wait()
    assert conn.items == [[b"i0", "cuda:1"], [b"i1", "cuda:0"], 2]  # in order, then the end
    assert conn.outcome == 3
    ticker.cancel()
    host.pool.shutdown()


@pytest.mark.asyncio
async def test_Producers_closed_while_an_item_is_held_drop_it_and_end_once() -> None:
    gpu, transfer, pipeline = setup()
    call = stream_call(pipeline)
    policy = pipeline.item_policy(call)

    def gen() -> Iterator[Any]:
        yield FakeTensor(0, b"x", nbytes=1)

    host = Host()
    producers, conn, told = host.producers(), Conn(host.serializer), []
    producers.expect(conn, 2, 7, "gen")
    producers.start(
        2, 7, gen, gen, (), {}, lambda ok, v: told.append(ok),
        partial(_dumps, host.serializer, policy), None, pipeline.items_ready(call),
    )  # fmt: skip
    producers.on_credit(2, 7, 10)
    await asyncio.sleep(0.05)
    producers.on_close(2, 7)
    gpu.run(transfer.out_stream(0))
    await asyncio.sleep(0.05)
    assert conn.items == []
    assert told == [False]  # closed once, its held item never sent
    assert len(producers) == 0
    host.pool.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_Producers_send_the_error_after_the_held_items_made_before_it(sync: bool) -> None:
    gpu, transfer, pipeline = setup()
    call = stream_call(pipeline)
    policy = pipeline.item_policy(call)

    def gen() -> Iterator[Any]:
        yield FakeTensor(0, b"x", nbytes=1)
        raise KeyError("after one item")

    async def agen() -> Any:
        for item in gen():
            yield item

    fn = gen if sync else agen
    host = Host()
    producers, conn = host.producers(), Conn(host.serializer)
    producers.expect(conn, 2, 7, "gen")
    producers.start(
        2, 7, fn, fn, (), {}, lambda ok, v: None, partial(_dumps, host.serializer, policy),
        None, pipeline.items_ready(call),
    )  # fmt: skip
    producers.on_credit(2, 7, 10)
    await asyncio.sleep(0.05)
    assert conn.outcome is None  # the error waits for the item held before it
    gpu.run(transfer.out_stream(0))
    async with asyncio.timeout(5):
        await conn.done.wait()
    assert conn.items == [[b"x", "cuda:1"]]
    assert isinstance(conn.outcome, KeyError)
    host.pool.shutdown()


# -- the consumer: copied in per item, each reader ordered after its item ---------------------


def test_each_received_item_is_copied_in_and_its_reader_waits_for_it_only() -> None:
    gpu, transfer, pipeline = setup()
    policy = pipeline.items_in(1)
    assert isinstance(policy, ItemArrivals)
    segment = torch.zeros(4, dtype=torch.uint8)
    policy.to_device(segment, "cuda:0")
    first = policy.take()
    assert policy.take() is None  # an item with no CUDA tensor: nothing to wait for
    assert first is not None
    assert labels(transfer.in_stream(0)) == ["copy to device 0 on " + transfer.in_stream(0).name]
    reader = gpu.new_stream(0)
    with gpu.use_streams([reader]):
        first()
    assert labels(reader) == ["wait for " + transfer.in_stream(0).name]
    assert gpu.current_stream(0) is gpu.default_stream(0)  # nothing else made to wait
    assert labels(gpu.default_stream(0)) == []


@pytest.mark.asyncio
async def test_Stream_orders_the_reading_thread_not_the_loop() -> None:
    gpu, transfer, pipeline = setup()
    policy = pipeline.items_in(1)
    assert policy is not None
    loop = asyncio.get_running_loop()
    consumer = ConsumerStream(loop, 1, 1, "w1", "m.gen", 0.0, 8, ConsumerHub())
    for seq in range(2):
        policy.to_device(torch.zeros(2, dtype=torch.uint8), "cuda:0")
        first = policy.take()
        assert first is not None
        consumer.flow.check(seq)
        consumer.on_item(seq, Arrived(f"item {seq}", first))
    consumer.finished(None)
    stream: Stream[str] = Stream(consumer, loop, threading.get_ident(), loop.call_soon_threadsafe)
    reader = gpu.new_stream(0)
    got: list[str] = []

    def read() -> None:
        with gpu.use_streams([reader]):
            got.extend(stream)

    await asyncio.to_thread(read)
    assert got == ["item 0", "item 1"]
    assert [w.label for w in reader.items] == ["wait for " + transfer.in_stream(0).name] * 2
    assert labels(gpu.default_stream(0)) == []  # the loop's thread was not made to wait


# -- the dispatcher: a stream argument's items are the sender's own --------------------------


@stream_source
def source_items() -> Iterator[int]:
    yield 1


def plain_items() -> Iterator[int]:
    yield 1


class Recorded:
    """Producers that record how a stream is started."""

    def __init__(self) -> None:
        self.started: list[tuple[Any, ...]] = []

    def expect(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forget(self, *args: Any) -> None:
        pass

    def start(self, *args: Any) -> None:
        self.started.append(args)


class Conn1:
    peer: int | None = 1
    peer_name: str | None = "w0"


def _stream_request(fn: Any) -> tuple[Request, Any, Any]:
    payload, segments, _, _ = Serializer().dumps((fn, (), {}))
    fields = Request(5, 0.0, CallMode.STREAM, "m.fn").to_fields()
    (frame,) = FrameDecoder().feed(
        b"".join(bytes(p) for p in encode_frame(fields, payload, segments))
    )
    request = decode_message(frame.fields)
    assert isinstance(request, Request)
    return request, frame.payload, frame.segments


@pytest.mark.asyncio
@pytest.mark.parametrize("fn", [source_items, plain_items], ids=["source", "plain"])
async def test_Dispatcher_gives_a_stream_argument_with_no_field_the_senders_map(fn: Any) -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu)
    pipeline = Pipeline([DeviceMapHook({"w0": {"cuda:0": "cuda:1"}}, transfer)])
    loop = asyncio.get_running_loop()
    workers = WorkerPool(1, loop, "me")
    producers = Recorded()
    dispatcher = Dispatcher(
        "me", Loop(loop, workers), Serializer(), lambda *a: None, Counters(), pipeline, NoRRefs(),
        producers, print_errors=False,  # type: ignore[arg-type]
    )  # fmt: skip
    dispatcher.on_request(Conn1(), *_stream_request(fn))  # type: ignore[arg-type]
    ((*_, dumps, _fields, ready, links),) = producers.started
    assert links is None  # no CUDA IPC here: nothing on the stream's frames
    workers.shutdown()
    if fn is plain_items:  # a stream the peer asked for without a map: CUDA is refused
        assert ready is None
        assert dumps.keywords["policy"] is None  # the defaults: a CUDA tensor is refused
        return
    assert ready is not None
    policy = dumps.keywords["policy"]
    assert isinstance(policy, ItemCopies)
    assert policy.device_map == {"cuda:0": "cuda:1"}
    policy.to_host(FakeTensor(0, b"x", nbytes=1))
    assert ready()[0] is not None  # its frame waits for its copy
