"""CUDA IPC for stream items, on FakeDevices sharing one simulated host (``FakeIpc``):
items go by handle exactly when a call to the same peer would (same host, probe passed,
"auto" or "ipc"), each costs its bytes in the byte credit, and the blocks come back named
in the stream frames that flow the other way (credit, close, a bidirectional stream's
items, the end), with one last close frame for what the end of a stream leaves owed.
Through the device-map hook, the pipeline and the real producers; the consumer is played
here from the frames the producers write (its hub is tested between processes in
``tests/integration/test_cuda_items.py``)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.protocol.wire.stream import ConsumerFlow, StreamEnd, StreamItem
from asyncrpc.protocol.wire.stream import decode_stream_message as decode
from asyncrpc.runtime.calls.pipeline import IncomingCall, Pipeline
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.fake import FakeIpc
from asyncrpc.runtime.cuda.ipc import STREAM_FIELD, is_ipc_tag
from asyncrpc.runtime.cuda.items import IpcStreamLinks, ItemCopies
from asyncrpc.runtime.cuda.maps import FIELD, DeviceMapHook
from asyncrpc.runtime.cuda.staging import StagedTransfer
from tests.aio.test_cuda_ipc import EMPTY, A, B, ipc, probed, settle, worker
from tests.aio.test_streams import Host

pytestmark = pytest.mark.timeout(20)

MIB = 1 << 20


def serving(transfer: StagedTransfer) -> tuple[Pipeline, IncomingCall]:
    """``transfer``'s worker (A) serving a stream to B, which sent a reply map."""
    pipeline = Pipeline([DeviceMapHook(None, transfer)])
    call = IncomingCall("w1", B, "w0", 7, "m.gen", False, {FIELD: {"cuda:0": "cuda:0"}})
    pipeline.receiving(call)
    return pipeline, call


def tensor(value: Any, nbytes: int = 64 << 10) -> FakeTensor:
    return FakeTensor(0, value, nbytes=nbytes)


# -- which way an item goes ------------------------------------------------------------------


def test_items_go_by_handle_once_the_probe_passed_and_cost_their_bytes() -> None:
    a, _ = probed()
    pipeline, call = serving(a)
    policy = pipeline.item_policy(call)
    ready = pipeline.items_ready(call)
    assert isinstance(policy, ItemCopies)
    assert ready is not None
    tag, _ = policy.to_host(tensor("x", 3 * MIB))
    assert is_ipc_tag(tag)
    wait, held = ready()
    assert wait is not None  # its frame waits for the fill into the block
    assert held == 3 * MIB  # the byte credit counts the bytes in the block
    assert ipc(a).shared == 1
    assert a.staged_out == 0


@pytest.mark.parametrize("case", ["probe not answered", "another host", "staged"])
def test_items_go_staged_where_a_call_would(case: str) -> None:
    a = worker(FakeIpc(), A)
    if case == "another host":
        a.ipc = type(ipc(a))(a.devices, lambda peer: False)
    elif case == "staged":
        a.ipc = None  # cuda_transfer="staged"
    else:
        ipc(a).field_out(B)  # offered, never answered
    pipeline, call = serving(a)
    policy = pipeline.item_policy(call)
    ready = pipeline.items_ready(call)
    assert policy is not None
    assert ready is not None
    tag, host = policy.to_host(tensor(b"ab", 2))
    assert tag == "cuda:0"
    assert host.fake_device is None  # a host copy, as a call's would be
    assert ready()[1] == 0  # its bytes are in the frame: nothing held by handle
    assert (pipeline.stream_links(B) is None) == (case != "probe not answered")


def test_forced_ipc_sends_items_by_handle_without_a_probe() -> None:
    a = worker(FakeIpc(), A, probe=False)
    pipeline, call = serving(a)
    policy = pipeline.item_policy(call)
    assert policy is not None
    assert is_ipc_tag(policy.to_host(tensor("x"))[0])


# -- the stream, through the producers -------------------------------------------------------


class Reader:
    """Worker B reading a stream from A: it decodes the frames A's producers write, opens
    each item's blocks (B's item policy), and grants credit as it consumes, with what its
    stream links carry for A (given to A's pipeline as A's hub would)."""

    def __init__(
        self, a: StagedTransfer, b: StagedTransfer, pipeline_a: Pipeline, window: int,
        window_bytes: int,
    ) -> None:  # fmt: skip
        self.a, self.b, self.pipeline_a = a, b, pipeline_a
        self.pipeline_b = Pipeline([DeviceMapHook(None, b)])
        self.items_in = self.pipeline_b.items_in(A)
        links = self.pipeline_b.stream_links(A)
        assert isinstance(links, IpcStreamLinks)
        self.links = links
        self.flow = ConsumerFlow(window, window_bytes)
        self.decoder = FrameDecoder()
        self.serializer = Serializer()
        self.values: list[Any] = []
        self.tags: list[str] = []
        self.sizes: list[int] = []
        self.unread = 0  # received, not consumed
        self.most_lent = 0  # A's blocks lent to B at most, as items arrived
        self.end: StreamEnd | None = None
        self.producers: Any = None

    def write(self, pieces: list[Any]) -> None:
        for piece in pieces:
            for frame in self.decoder.feed(bytes(piece)):
                message = decode(frame.fields)
                if message.headers:
                    self.pipeline_b.stream_received(A, message.headers)
                if isinstance(message, StreamEnd):
                    self.end = message
                elif isinstance(message, StreamItem):
                    self._item(message, frame)

    def _item(self, item: StreamItem, frame: Any) -> None:
        self.flow.check(item.seq, item.nbytes)
        self.sizes.append(item.nbytes)
        assert self.items_in is not None
        for tag in frame.tags:  # as the serializer would, for an empty IPC segment
            self.values.append(self.items_in.to_device(EMPTY, tag).value)
            self.tags.append(tag)
        self.items_in.take()
        self.unread += 1
        self.most_lent = max(self.most_lent, ipc(self.a).outstanding(B))

    def consume(self, count: int | None = None) -> None:
        count = self.unread if count is None else count
        self.unread -= count
        granted, nbytes = self.flow.consumed(count)
        if granted:
            fields = self.links.fields()  # B's credit frame to A, with its field
            if fields:
                self.pipeline_a.stream_received(B, dict(fields))
            self.producers.on_credit(B, 7, granted, nbytes)


def _dumps(serializer: Serializer, policy: Any, item: FakeTensor) -> Any:
    """Pickle ``item`` as the serializer does a CUDA tensor: its tag from the policy, and
    an empty segment for a handle (a FakeTensor is no torch tensor: asked here)."""
    tag, _ = policy.to_host(item)
    payload, segments, keep, forks = serializer.dumps(item.value)
    return payload, [*segments, (memoryview(b""), tag)], keep, forks


async def _gpus(*transfers: StagedTransfer) -> None:
    while True:  # both fake GPUs run by themselves, as a GPU would
        settle(*transfers)
        await asyncio.sleep(0.001)


def _stream(
    a: StagedTransfer, b: StagedTransfer, fn: Any, window: int, window_bytes: int
) -> tuple[Reader, Any, Host]:
    pipeline, call = serving(a)
    policy = pipeline.item_policy(call)
    host = Host()
    reader = Reader(a, b, pipeline, window, window_bytes)
    producers = reader.producers = host.producers()
    producers.expect(reader, B, 7, "m.gen")
    dumps = functools.partial(_dumps, host.serializer, policy)
    producers.start(
        B, 7, fn, fn, (), {}, lambda ok, v: None, dumps, None, pipeline.items_ready(call),
        pipeline.stream_links(B),
    )  # fmt: skip
    settle(a, b)  # the probes' copies ran: the first credit names their blocks back
    fields = reader.links.fields()
    if fields:
        pipeline.stream_received(B, dict(fields))
    producers.on_credit(B, 7, *reader.flow.initial())
    return reader, producers, host


async def _until(condition: Any) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 (polled: frames and GPUs move it)
            await asyncio.sleep(0.002)


@pytest.mark.asyncio
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_a_long_stream_with_only_credit_flowing_back_gives_every_block_back(
    sync: bool,
) -> None:
    a, b = probed()
    n, window = 300, 8

    def gen() -> Iterator[FakeTensor]:
        for i in range(n):
            yield tensor(i)

    async def agen() -> AsyncIterator[FakeTensor]:
        for item in gen():
            yield item

    fn = gen if sync else agen
    gpus = asyncio.ensure_future(_gpus(a, b))
    reader, _, host = _stream(a, b, fn, window, 0)
    try:
        while reader.end is None:
            await _until(lambda: reader.unread or reader.end is not None)
            reader.consume()  # credit is all that flows back
        assert reader.values == list(range(n))  # every item, whole and in order
        assert all(is_ipc_tag(tag) for tag in reader.tags)  # each by handle
        assert ipc(a).shared == n
        # Lent at most: the window unread, and those the last credit acknowledged while
        # their copies out were still running (named back with the next frame).
        assert reader.most_lent <= 2 * window
        assert ipc(a).blocks.made <= 2 * window + 1  # blocks reused (and the probe's)
        # The stream is over: what is still owed goes once its copies are done.
        owed = reader.links.owed()
        if owed is not None:
            await asyncio.wait_for(owed, 5)  # type: ignore[arg-type]
        fields = reader.links.fields()  # the hub's last close frame
        if fields:
            reader.pipeline_a.stream_received(B, dict(fields))
        assert ipc(a).outstanding(B) == 0
        assert reader.links.owed() is None
    finally:
        gpus.cancel()
        host.pool.shutdown()


@pytest.mark.asyncio
async def test_a_stalled_consumer_holds_at_most_its_byte_window_of_blocks() -> None:
    a, b = probed()
    window_bytes = 4 * MIB

    async def big() -> AsyncIterator[FakeTensor]:
        i = 0
        while True:
            yield tensor(i, MIB)
            i += 1

    gpus = asyncio.ensure_future(_gpus(a, b))
    reader, producers, host = _stream(a, b, big, 128, window_bytes)
    try:
        await _until(lambda: reader.unread == 4)
        await asyncio.sleep(0.1)  # nothing more comes: the byte window is spent
        assert reader.unread == 4
        assert all(is_ipc_tag(tag) for tag in reader.tags)
        assert sum(reader.sizes) >= window_bytes  # each counted with its block's bytes
        assert ipc(a).outstanding(B) == 4  # a 128-item window: the bytes stopped it
        assert ipc(a).stats()["cuda_ipc_block_bytes"] <= window_bytes + 2 * MIB
        reader.consume()  # the reader goes on: blocks come back, and are filled again
        await _until(lambda: reader.unread == 4 and len(reader.values) == 8)
        assert ipc(a).outstanding(B) <= 6
        assert ipc(a).blocks.made <= 7
        producers.on_close(B, 7)
    finally:
        gpus.cancel()
        host.pool.shutdown()


# -- items nobody reads, and items never sent -------------------------------------------------


def test_an_item_for_a_closed_stream_gives_its_block_back_unread() -> None:
    host = FakeIpc()
    a, b = probed(host)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))  # the probes' blocks, named back
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(tensor("x"))
    settle(a)
    links = b.links(A)
    assert links is not None
    links.dropped(["cpu", tag])  # the hub's path for an item whose stream is gone
    fields = links.fields()
    assert fields is not None
    assert fields[STREAM_FIELD]["u"] == [int(tag.split(":")[3])]
    DeviceMapHook(None, a).stream_received(B, dict(fields))
    assert ipc(a).outstanding(B) == 0
    # Not counted as opened there: a lost peer drops no reference it never took.
    ipc(a).on_peer_lost(B)
    assert host.over_released == 0


@pytest.mark.asyncio
async def test_Producers_closed_with_an_item_held_take_its_block_back() -> None:
    host_ipc = FakeIpc()
    a, b = probed(host_ipc)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))
    go = asyncio.Event()

    async def one() -> AsyncIterator[FakeTensor]:
        await go.wait()
        yield tensor("x")

    reader, producers, host = _stream(a, b, one, 8, 0)
    gpu = a.devices
    assert isinstance(gpu, FakeDevices)
    kernel = gpu.launch(gpu.default_stream(0), "makes the item")
    go.set()
    try:
        await _until(lambda: ipc(a).outstanding(B) == 1)
        await asyncio.sleep(0.02)
        assert reader.values == []  # held: its fill waits behind the kernel
        producers.on_close(B, 7)
        assert ipc(a).outstanding(B) == 0  # taken back, never sent
        made = ipc(a).blocks.made
        again = a.policy({"cuda:0": "cuda:0"}, B)
        again.to_host(tensor("y"))
        assert ipc(a).blocks.made == made + 1  # its fill has not run: not lent again yet
        assert not kernel.done
        settle(a)
        ipc(a).on_peer_lost(B)
        assert host_ipc.over_released == 0  # never opened there: not counted so
    finally:
        host.pool.shutdown()
