"""asyncio tests of the idle closer's rules (``runtime/net/idle.py``) over a stand-in
connection: when it asks, and what it does with the peer's ask or refusal."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.protocol.wire.messages import Idle, decode_message
from asyncrpc.runtime.net.idle import IdleCloser
from asyncrpc.runtime.net.peers import PeerTable

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class FakeConn:
    """The parts of a Connection the closer uses; what it writes, decoded."""

    def __init__(self, peer: int) -> None:
        self.peer: int | None = peer
        self.peer_name = f"w{peer}"
        self.closed = False
        self.idle: str | None = None
        self.frames_in = 0
        self.sent: list[Any] = []

    def send(self, pieces: Any, keepalive: object = None) -> None:
        decoder = FrameDecoder()
        data = b"".join(bytes(p) for p in pieces)
        buffer = decoder.get_buffer(len(data))
        buffer[: len(data)] = data
        frames = decoder.buffer_updated(len(data))
        self.sent.extend(decode_message(f.fields) for f in frames)

    def close(self) -> None:
        self.closed = True


def _setup(busy: set[int], timeout: float = 0.1) -> tuple[IdleCloser, PeerTable, FakeConn]:
    peers = PeerTable(
        "w0", 0, {1: PeerAddress("w1", 1, "127.0.0.1", 1)}, lambda i: None,  # type: ignore[arg-type,return-value]
        b"k", 1 << 20, lambda c, e: None,
    )  # fmt: skip
    conn = FakeConn(1)
    peers.peers[1].conn = conn  # type: ignore[assignment]
    closer = IdleCloser(
        asyncio.get_running_loop(), timeout, lambda: [conn], peers,  # type: ignore[list-item]
        lambda: busy, lambda rank: 0,
    )  # fmt: skip
    return closer, peers, conn


async def test_IdleCloser_asks_once_a_connection_is_idle_and_nothing_is_in_flight() -> None:
    busy = {1}
    closer, peers, conn = _setup(busy)
    closer.start()
    try:
        await asyncio.sleep(0.3)
        assert conn.sent == []  # a call in flight: no ask
        busy.clear()
        await asyncio.sleep(0.3)
        assert conn.sent == [Idle(True)]
        assert conn.idle == "asked"
        assert peers.peers[1].conn is None  # later frames wait for a new connection
        assert not conn.closed  # the peer closes it, or refuses
    finally:
        closer.stop()


async def test_IdleCloser_refuses_an_ask_while_busy_and_takes_back_a_refused_ask() -> None:
    busy = {1}
    closer, peers, conn = _setup(busy)
    closer.on_idle(conn, ask=True)  # type: ignore[arg-type]
    assert conn.sent == [Idle(False)]
    assert not conn.closed
    assert peers.peers[1].conn is conn
    # This side asked; the peer refused: the connection is the peer's again.
    conn.idle = "asked"
    peers.peers[1].conn = None
    closer.on_idle(conn, ask=False)  # type: ignore[arg-type]
    assert conn.idle is None
    assert peers.peers[1].conn is conn
    assert await asyncio.wait_for(peers.connection(1), 1) is conn


async def test_IdleCloser_closes_on_an_ask_when_free_and_when_asks_cross() -> None:
    closer, peers, conn = _setup(set())
    closer.on_idle(conn, ask=True)  # type: ignore[arg-type]
    assert conn.closed
    assert conn.idle == "closing"
    assert peers.peers[1].conn is None
    assert conn.sent == []
    # Both asked at once (each wrote its last frame): both close.
    closer, peers, conn = _setup({1})
    conn.idle = "asked"
    peers.peers[1].conn = None
    closer.on_idle(conn, ask=True)  # type: ignore[arg-type]
    assert conn.closed
