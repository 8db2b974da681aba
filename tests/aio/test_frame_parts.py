"""A frame written in parts over a real loopback socket (``Connection.begin_parts`` and
``links.write_in_parts``): the frame arrives whole, frames sent meanwhile follow it in
order, a frame cut short aborts the connection, and a second parted frame waits its turn.
Used by staged CUDA transfers to overlap a tensor's copy to the host with its write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest

from asyncrpc.errors import ClosedError, FrameTooLargeError, ProtocolError
from asyncrpc.protocol.wire import Frame, FrameDecoder, encode_frame
from asyncrpc.runtime.cuda.callee import _ReleasingParts
from asyncrpc.runtime.net.links import FrameInParts, write_in_parts
from asyncrpc.runtime.net.transport import Connection, open_connection, start_server
from tests.ordering import until_async

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class Recorder:
    """The receiving side's handler: the frames it decoded, and whether it lost the link."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.arrived = asyncio.Event()
        self.lost = asyncio.Event()

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        self.arrived.set()

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        self.lost.set()

    def on_protocol_error(self, conn: Connection, exc: ProtocolError) -> None:
        pass

    async def until(self, count: int) -> list[Any]:
        async with asyncio.timeout(5):
            while len(self.frames) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return [
            (f.fields[0], bytes(f.payload), [bytes(s) for s in f.segments]) for f in self.frames
        ]


class Gated:
    """A frame's parts, each let out by the test (``release(i)``), as a staged copy's are."""

    def __init__(self, cuts: list[int]) -> None:
        self.cuts = cuts
        self.gates = [asyncio.Event() for _ in range(len(cuts) + 1)]
        self.yielded = 0

    def release(self, index: int) -> None:
        self.gates[index].set()

    async def parts(self, pieces: list[Any]) -> AsyncIterator[list[Any]]:
        flat = b"".join(bytes(p) for p in pieces)
        bounds = [0, *self.cuts, len(flat)]
        for index in range(len(bounds) - 1):  # bounded by the cuts
            await self.gates[index].wait()
            self.yielded += 1
            yield [memoryview(flat)[bounds[index] : bounds[index + 1]]]

    def __await__(self) -> Generator[Any, None, None]:
        for gate in self.gates:
            yield from gate.wait().__await__()


async def _pair() -> tuple[Connection, Recorder, asyncio.Server]:
    recorder = Recorder()
    server, port = await start_server(
        "127.0.0.1", lambda: Connection(recorder, FrameDecoder(), initiated=False)
    )
    sender = Recorder()
    conn = await open_connection(
        "127.0.0.1", port, lambda: Connection(sender, FrameDecoder(), initiated=True)
    )
    return conn, recorder, server


def _frame(tag: int, size: int) -> list[Any]:
    segment = memoryview(bytes(range(256)) * (size // 256))
    return encode_frame([tag], f"payload {tag}".encode(), [(segment, "cpu")])


async def test_a_frame_in_parts_arrives_whole_and_frames_sent_meanwhile_follow_it() -> None:
    conn, recorder, server = await _pair()
    try:
        gated = Gated([10, 500, 3000])
        assert isinstance(gated, FrameInParts)
        writing = asyncio.create_task(write_in_parts(conn, _frame(1, 4096), gated))
        gated.release(0)
        await until_async(lambda: gated.yielded == 1, what="the first part written")
        conn.send(_frame(2, 256))  # sent while the big frame is half out: held
        conn.send(_frame(3, 256))
        assert conn.in_parts
        assert recorder.frames == []
        for index in (1, 2, 3):
            gated.release(index)
        await writing
        frames = await recorder.until(3)
        assert [tag for tag, _, _ in frames] == [1, 2, 3]
        assert frames[0][2] == [bytes(range(256)) * 16]  # the parted segment, byte for byte
        assert frames[0][1] == b"payload 1"
        assert gated.yielded == 4
        assert not conn.in_parts
    finally:
        conn.close()
        server.close()


async def test_a_frame_cut_short_aborts_the_connection_and_drops_what_was_held() -> None:
    conn, recorder, server = await _pair()
    try:
        gated = Gated([100])
        writing = asyncio.create_task(write_in_parts(conn, _frame(1, 1024), gated))
        gated.release(0)
        await until_async(lambda: gated.yielded == 1, what="the first part written")
        conn.send(_frame(2, 256))
        writing.cancel()  # a shutdown while the rest of the tensor was still being copied
        with pytest.raises(asyncio.CancelledError):
            await writing
        async with asyncio.timeout(5):
            await recorder.lost.wait()
        assert recorder.frames == []  # the peer never read a frame cut short
        assert conn.closed
        with pytest.raises(ClosedError):
            conn.send(_frame(3, 256))
    finally:
        server.close()


async def test_a_second_frame_in_parts_waits_and_follows_the_first_whole() -> None:
    conn, recorder, server = await _pair()
    try:
        first, second = Gated([50]), Gated([50])
        one = asyncio.create_task(write_in_parts(conn, _frame(1, 512), first))
        await until_async(lambda: conn.in_parts, what="frame 1 begun in parts")
        two = asyncio.create_task(write_in_parts(conn, _frame(2, 512), second))
        second.release(0)
        second.release(1)  # ready first, but the connection is busy with frame 1
        await until_async(two.done, what="frame 2 handed over whole")
        assert recorder.frames == []  # held behind frame 1, none of whose parts is ready
        first.release(0)
        first.release(1)
        await asyncio.gather(one, two)
        assert [tag for tag, _, _ in await recorder.until(2)] == [1, 2]
        assert second.yielded == 0  # written whole, once all its bytes were there
    finally:
        conn.close()
        server.close()


async def test_a_frame_over_the_peer_limit_is_refused_before_any_part() -> None:
    conn, recorder, server = await _pair()
    try:
        conn.peer_max_frame = 1000
        gated = Gated([10])
        with pytest.raises(FrameTooLargeError):
            await write_in_parts(conn, _frame(1, 4096), gated)
        assert gated.yielded == 0
        assert not conn.in_parts
        conn.send(_frame(2, 256))
        assert [tag for tag, _, _ in await recorder.until(1)] == [2]
    finally:
        conn.close()
        server.close()


async def test_a_callee_reply_in_parts_gives_its_stream_lease_back_after_the_last_part() -> None:
    released: list[str] = []
    inner = Gated([4])
    for gate in range(2):
        inner.release(gate)
    parts = _ReleasingParts(inner, lambda: released.append("lease"))
    assert isinstance(parts, FrameInParts)
    seen = [bytes(p[0]) async for p in parts.parts([b"0123456789"])]
    assert seen == [b"0123", b"456789"]
    assert released == ["lease"]
    # A writer that stops early (its connection closed) closes the parts: released too.
    gated = Gated([4])
    stopped = _ReleasingParts(gated, lambda: released.append("early"))
    iterator = stopped.parts([b"0123456789"])
    gated.release(0)
    assert bytes((await anext(iterator))[0]) == b"0123"
    await iterator.aclose()  # type: ignore[attr-defined]
    assert released == ["lease", "early"]
