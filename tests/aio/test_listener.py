"""asyncio tests of the listener that is open before the group is joined
(``asyncrpc.runtime.net.listener``): it parks what it accepts and hands it over in order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.errors import ProtocolError
from asyncrpc.protocol.wire import PROTOCOL_VERSION, Frame, bytearray_allocator, encode_frame
from asyncrpc.protocol.wire.messages import Hello, Kind
from asyncrpc.runtime.net.listener import Listener, Parked
from asyncrpc.runtime.net.transport import Connection

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class Taker:
    """Stands in for the network: takes the parked connections and records their frames."""

    def __init__(self) -> None:
        self.parked: list[tuple[Connection, list[Frame]]] = []
        self.frames: list[Frame] = []
        self.arrived = asyncio.Event()

    def accept(self) -> Connection:
        raise AssertionError("no connection is accepted after the hand-over in these tests")

    def take_parked(self, conn: Connection, parked: Parked) -> None:
        self.parked.append((conn, list(parked.frames)))

    def allocate(self, conn: Connection, nbytes: int, tag: str) -> tuple[object, memoryview]:
        return bytearray_allocator(nbytes, tag)

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        self.arrived.set()

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        pass

    def on_protocol_error(self, conn: Connection, exc: ProtocolError) -> None:
        pass


def _hello(rank: int) -> bytes:
    pieces: list[Any] = encode_frame(Hello(PROTOCOL_VERSION, f"w{rank}", rank).to_fields(), b"")
    return b"".join(bytes(p) for p in pieces)


class SignalledListener(Listener):
    """A listener that says when it has parked a frame."""

    parked_one: asyncio.Event

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        super().on_frame(conn, frame)
        self.parked_one.set()


async def test_Listener_parks_connections_and_their_frames_until_attached() -> None:
    SignalledListener.parked_one = asyncio.Event()
    listener = await SignalledListener.start("127.0.0.1", 0, None, unix_sockets=False)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(_hello(1))
        await writer.drain()
        async with asyncio.timeout(5):
            await SignalledListener.parked_one.wait()
        taker = Taker()
        listener.attach(taker)
        ((_, frames),) = taker.parked
        assert [f.fields[0] for f in frames] == [Kind.HELLO]
        # From now on the connection's frames go to the taker.
        writer.write(_hello(1))
        await writer.drain()
        async with asyncio.timeout(5):
            await taker.arrived.wait()
        assert taker.frames[0].fields[:4] == [Kind.HELLO, PROTOCOL_VERSION, "w1", 1]
        writer.close()
    finally:
        listener.close()


async def test_Listener_closes_a_connection_that_sends_too_much_before_the_join() -> None:
    listener = await Listener.start("127.0.0.1", 0, None, unix_sockets=False)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(_hello(1) * 3)  # the acceptor's side of a handshake is two frames
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the listener
        taker = Taker()
        listener.attach(taker)
        assert taker.parked == []  # nothing left to hand over
        writer.close()
    finally:
        listener.close()
