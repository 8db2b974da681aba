"""asyncio tests of the stream runtime in one process, without an agent: the consumer's
state (``runtime/calls/streams/consumer.py``) against a fake hub, and the producers
(``runtime/calls/streams/producer.py``) against a fake host that decodes what they write."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
import torch

from asyncrpc.errors import FrameTooLargeError, RpcTimeoutError, SerializationError
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, FrameDecoder, frame_nbytes
from asyncrpc.protocol.wire.messages import Kind
from asyncrpc.protocol.wire.stream import (
    StreamEnd,
    StreamError,
    StreamItem,
    decode_stream_message,
)
from asyncrpc.runtime.calls.pipeline import StreamLinks
from asyncrpc.runtime.calls.streams.consumer import ConsumerStream
from asyncrpc.runtime.calls.streams.hub import _plain
from asyncrpc.runtime.calls.streams.producer import Producers
from asyncrpc.runtime.ports import Loop
from asyncrpc.runtime.threads.pool import WorkerPool

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]


# -- the consumer's side ---------------------------------------------------------------------


class Hub:
    """Records the credit a consumer grants and whether it closed."""

    def __init__(self) -> None:
        self.granted: list[int] = []
        self.granted_bytes: list[int] = []
        self.closed: list[ConsumerStream] = []

    def grant(self, stream: ConsumerStream, count: int, nbytes: int) -> None:
        self.granted.append(count)
        self.granted_bytes.append(nbytes)

    def close_stream(self, stream: ConsumerStream) -> None:
        self.closed.append(stream)
        stream.shut(None)


def _consumer(hub: Hub, window: int = 8, timeout: float = 0.0) -> ConsumerStream:
    loop = asyncio.get_running_loop()
    return ConsumerStream(loop, 1, 2, "w2", "mod.gen", timeout, window, hub)


async def _fetch(stream: ConsumerStream, consumed: int) -> list[Any]:
    waiter: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    stream.fetch(consumed, waiter)
    async with asyncio.timeout(5):
        return await waiter


async def test_ConsumerStream_hands_items_in_batches_of_half_a_window() -> None:
    hub = Hub()
    stream = _consumer(hub, window=8)
    for seq in range(8):
        stream.flow.check(seq)
        stream.on_item(seq, seq)
    assert await _fetch(stream, 0) == [0, 1, 2, 3]
    assert hub.granted == []  # nothing consumed yet
    assert await _fetch(stream, 4) == [4, 5, 6, 7]
    assert hub.granted == [4]  # half a window consumed: granted in one frame


async def test_ConsumerStream_grants_the_bytes_of_the_items_consumed() -> None:
    hub = Hub()
    loop = asyncio.get_running_loop()
    stream = ConsumerStream(loop, 1, 2, "w2", "mod.gen", 0.0, 128, hub, window_bytes=100)
    for seq in range(3):
        stream.flow.check(seq, 30)
        stream.on_item(seq, seq)
    assert await _fetch(stream, 0) == [0, 1, 2]
    assert hub.granted == []
    stream.flow.check(3, 30)
    stream.on_item(3, 3)
    assert await _fetch(stream, 2) == [3]  # 60 of 100 bytes taken: half the byte window
    assert (hub.granted, hub.granted_bytes) == ([2], [60])


async def test_ConsumerStream_a_waiting_fetch_gets_the_items_of_one_pass_together() -> None:
    stream = _consumer(Hub())
    waiter: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    stream.fetch(0, waiter)
    for seq in range(3):  # three frames of one read pass
        stream.flow.check(seq)
        stream.on_item(seq, f"item{seq}")
    async with asyncio.timeout(5):
        assert await waiter == ["item0", "item1", "item2"]


async def test_ConsumerStream_error_comes_after_the_items_then_the_end() -> None:
    stream = _consumer(Hub())
    stream.flow.check(0)
    stream.on_item(0, "a")
    stream.finished(KeyError("broken"))
    assert await _fetch(stream, 0) == ["a"]
    with pytest.raises(KeyError):
        await _fetch(stream, 1)
    assert await _fetch(stream, 0) == []  # raised once; then the stream is over


async def test_ConsumerStream_item_timeout_raises_and_closes() -> None:
    hub = Hub()
    stream = _consumer(hub, timeout=0.05)
    with pytest.raises(RpcTimeoutError):
        await _fetch(stream, 0)
    assert hub.closed == [stream]
    assert await _fetch(stream, 0) == []


# -- the producer's side ---------------------------------------------------------------------


class Conn:
    """A connection that decodes the frames written on it."""

    def __init__(self, serializer: Serializer) -> None:
        self.decoder = FrameDecoder()
        self.serializer = serializer
        self.items: list[Any] = []
        self.sizes: list[int] = []  # what each item says it costs in byte credit
        self.plain: list[bool] = []  # whether each came as a plain pickle (STREAM_VALUE)
        self.outcome: Any = None
        self.done = asyncio.Event()
        self.peer_max_frame = 0

    def write(self, pieces: list[Any]) -> None:
        for piece in pieces:
            for frame in self.decoder.feed(bytes(piece)):
                message = decode_stream_message(frame.fields)
                if isinstance(message, StreamItem):
                    assert message.seq == len(self.items)
                    self.sizes.append(message.nbytes)
                    self.plain.append(message.plain)
                    self.items.append(self.serializer.loads(frame.payload, frame.segments))
                elif isinstance(message, StreamEnd):
                    self.outcome = message.count
                    self.done.set()
                elif isinstance(message, StreamError):
                    self.outcome = unpack_exception(bytes(frame.payload))
                    self.done.set()


class Host:
    """What the producers are built from: a real loop, pool and serializer, and frames
    written on fake connections."""

    name = "w1"

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.pool = WorkerPool(2, loop, "test")
        self.loop = Loop(loop, self.pool)
        self.serializer = Serializer()

    def write(self, conn: Any, pieces: list[Any], keep: object = None, forks: Any = None) -> None:
        conn.write(pieces)

    def producers(self) -> Producers:
        frames: Any = self  # writes on a given connection: all the producers need of Frames
        return Producers(self.name, self.loop, frames, lambda rank, forks: None)


PRODUCED: list[int] = []
CLOSED = threading.Event()


def endless() -> Iterator[int]:
    try:
        i = 0
        while True:
            PRODUCED.append(i)
            yield i
            i += 1
    finally:
        CLOSED.set()


async def aendless() -> AsyncIterator[int]:
    try:
        i = 0
        while True:
            PRODUCED.append(i)
            yield i
            i += 1
    finally:
        CLOSED.set()


def _replying(record: list[tuple[bool, Any]]) -> Any:
    def replying(ok: bool, value: Any) -> None:
        record.append((ok, value))

    return replying


async def _until(condition: Any) -> None:
    # Polled: the conditions change on pool threads and in frames, not through events.
    async with asyncio.timeout(5):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("fn", [endless, aendless], ids=["sync", "async"])
async def test_Producers_advance_only_within_credit_and_close_runs_finally(fn: Any) -> None:
    PRODUCED.clear()
    CLOSED.clear()
    host = Host()
    producers, conn, told = host.producers(), Conn(host.serializer), []
    producers.expect(conn, 2, 7, "gen")
    producers.start(2, 7, fn, fn, (), {}, _replying(told), host.serializer.dumps)
    # Left as a sleep: this checks that nothing happens (no step without credit), and no
    # public event marks "parked for credit" (the parking differs for sync and async
    # producers, inside the runtime). A producer that ran ahead would fail it.
    await asyncio.sleep(0.05)
    assert PRODUCED == []  # no credit yet: not advanced at all
    producers.on_credit(2, 7, 3)
    await _until(lambda: len(conn.items) == 3)
    await asyncio.sleep(0.05)  # nothing more may happen (see above: why a sleep)
    assert conn.items == [0, 1, 2]
    assert len(PRODUCED) == 3  # never past the credit
    producers.on_close(2, 7)
    await _until(CLOSED.is_set)
    assert len(producers) == 0
    assert [ok for ok, _ in told] == [False]  # the pipeline heard it ended, once
    host.pool.shutdown()


def endless_blobs() -> Iterator[bytes]:
    for i in endless():
        yield bytes(1000) + bytes([i % 256])


async def aendless_blobs() -> AsyncIterator[bytes]:
    async for i in aendless():
        yield bytes(1000) + bytes([i % 256])


@pytest.mark.parametrize("fn", [endless_blobs, aendless_blobs], ids=["sync", "async"])
async def test_Producers_stop_once_the_items_made_spend_the_byte_credit(fn: Any) -> None:
    PRODUCED.clear()
    CLOSED.clear()
    host = Host()
    producers, conn = host.producers(), Conn(host.serializer)
    producers.expect(conn, 2, 7, "gen")
    producers.start(2, 7, fn, fn, (), {}, _replying([]), host.serializer.dumps)
    producers.on_credit(2, 7, 100, 2500)  # items of ~1 kB: the bytes run out first
    await _until(lambda: len(conn.items) == 3)
    await asyncio.sleep(0.05)  # nothing more may happen (as above: why a sleep)
    assert len(PRODUCED) == 3  # made while credit was left: 0, ~1000 and ~2000 bytes
    assert all(1001 <= size < 1100 for size in conn.sizes)  # the pickle of 1001 bytes
    producers.on_credit(2, 7, 1, conn.sizes[0])  # one consumed: room for one more
    await _until(lambda: len(conn.items) == 4)
    await asyncio.sleep(0.05)
    assert len(PRODUCED) == 4
    producers.on_close(2, 7)
    await _until(CLOSED.is_set)
    host.pool.shutdown()


def three_then_error() -> Iterator[int]:
    yield from range(3)
    raise KeyError("done")


async def test_Producers_send_items_then_the_error_or_the_end() -> None:
    host = Host()
    producers = host.producers()
    broken, clean = Conn(host.serializer), Conn(host.serializer)
    producers.expect(broken, 2, 1, "gen")
    producers.expect(clean, 2, 2, "gen")
    dumps = host.serializer.dumps
    producers.start(2, 1, three_then_error, three_then_error, (), {}, _replying([]), dumps)
    producers.start(2, 2, range, range, (5,), {}, _replying([]), dumps)  # returns an iterable
    producers.on_credit(2, 1, 100)
    producers.on_credit(2, 2, 100)
    async with asyncio.timeout(5):
        await broken.done.wait()
        await clean.done.wait()
    assert broken.items == [0, 1, 2]
    assert isinstance(broken.outcome, KeyError)
    assert clean.items == [0, 1, 2, 3, 4]
    assert clean.outcome == 5
    assert len(producers) == 0
    host.pool.shutdown()


class Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x

    __hash__ = None  # type: ignore[assignment]


def mixed() -> Iterator[Any]:
    yield from (1, 2.5, "s", b"b", True, None, Point(3), (1, 2), 1 << 70)


async def test_Producers_send_scalars_as_plain_pickles_and_the_rest_through_the_serializer() -> (
    None
):
    host = Host()
    producers, conn = host.producers(), Conn(host.serializer)
    producers.expect(conn, 2, 7, "gen")
    producers.start(2, 7, mixed, mixed, (), {}, _replying([]), host.serializer.dumps)
    producers.on_credit(2, 7, 16)
    async with asyncio.timeout(5):
        await conn.done.wait()
    assert conn.items == list(mixed())  # the same values, whichever way they were pickled
    assert conn.plain == [True] * 6 + [False, False, True]  # exact scalar types only
    host.pool.shutdown()


async def test_a_plain_item_that_is_not_one_is_a_SerializationError() -> None:
    item = [Kind.STREAM_VALUE, 1, 0, 5, []]
    assert _plain(Frame(item, pickle.dumps(7, 5), [], [])) == 7
    with pytest.raises(SerializationError):  # a plain item carries no segment
        _plain(Frame(item, pickle.dumps(7, 5), [b"x"], ["cpu"]))
    with pytest.raises(SerializationError):
        _plain(Frame(item, b"not a pickle", [], []))


class Told(StreamLinks):
    """Stream links that record the items taken back unsent."""

    def __init__(self) -> None:
        self.unsent_tags: list[list[str]] = []

    def unsent(self, tags: Sequence[str]) -> None:
        self.unsent_tags.append(list(tags))


class Limited(Conn):
    """A connection whose peer takes frames of at most ``peer_max_frame`` bytes."""

    def write(self, pieces: list[Any]) -> None:
        size = frame_nbytes(pieces)
        if size > self.peer_max_frame:
            raise FrameTooLargeError(size, self.peer_max_frame, "w2")
        super().write(pieces)


def tensors() -> Iterator[torch.Tensor]:
    for i in range(3):
        yield torch.full((1 << 16,), i, dtype=torch.uint8)  # a segment each


async def test_Producers_items_refused_as_too_large_are_dropped_and_taken_back() -> None:
    host = Host()
    producers, conn, links = host.producers(), Limited(host.serializer), Told()
    conn.peer_max_frame = 3000  # every item's frame is larger: the first write is refused
    producers.expect(conn, 2, 7, "gen")
    producers.start(
        2, 7, tensors, tensors, (), {}, _replying([]), host.serializer.dumps, None, None, links
    )
    producers.on_credit(2, 7, 16)
    async with asyncio.timeout(5):
        await conn.done.wait()
    assert isinstance(conn.outcome, FrameTooLargeError)
    assert conn.items == []
    assert links.unsent_tags  # every item made and not written was taken back
    assert all(tags == ["cpu"] for tags in links.unsent_tags)
    assert len(producers) == 0
    host.pool.shutdown()
