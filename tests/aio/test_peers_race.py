"""asyncio tests of two PeerTables dialling each other at once over real Unix sockets: the
handshake's rule that exactly one connection survives, also when one side is slow to read.

The 64-worker all-to-all once lost a call to "Broken pipe" under a load of 40: the lower
rank, challenged by the higher rank's dial for longer than a quarter of a second, dialled
too; the higher rank accepted that dial and then adopted its own, so each side adopted a
different connection and then closed the other's, with requests already written on them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.protocol.wire.messages import Hello, HelloReply, decode_message
from asyncrpc.runtime.net.peers import PeerTable
from asyncrpc.runtime.net.transport import Connection, open_unix_connection, start_unix_server

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]


class Side:
    """One worker's peer table with the part of the network that feeds its handshakes;
    ``hold_reply`` delays the HelloReply of its own dial until ``release`` (a slow reader)."""

    def __init__(self, name: str, rank: int, addresses: dict[int, PeerAddress]) -> None:
        self.table = PeerTable(
            name, rank, addresses, self.connection, b"key", 1 << 20, lambda c, e: c.abort(e),
            dial=self.dial,
        )  # fmt: skip
        self.hold_reply = False
        self.held: list[Callable[[], None]] = []
        self.adopted_closed: list[Connection] = []  # adopted, then closed under this side
        self.hello_seen = asyncio.Event()

    def connection(self, initiated: bool) -> Connection:
        return Connection(self, FrameDecoder(), initiated=initiated)

    async def dial(self, address: PeerAddress, factory: Callable[[], Connection]) -> Connection:
        assert address.unix_path is not None
        return await open_unix_connection(address.unix_path, factory)

    def release(self) -> None:
        self.hold_reply = False
        held, self.held = self.held, []
        for deliver in held:
            deliver()

    # -- ConnectionHandler ---------------------------------------------------------------

    def on_frame(self, conn: Connection, frame: Any) -> None:
        message = decode_message(frame.fields)
        if conn.peer is not None:
            return  # nothing but handshakes in these tests
        if isinstance(message, HelloReply) and self.hold_reply:
            self.held.append(lambda: self.table.on_handshake(conn, message))
            return
        self.table.on_handshake(conn, message)
        if isinstance(message, Hello):
            self.hello_seen.set()
            if self.hold_reply:  # the held answer is read right behind this Hello
                self.release()

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        if conn.peer is not None:
            self.adopted_closed.append(conn)
        self.table.on_lost(conn, exc)

    def on_protocol_error(self, conn: Connection, exc: BaseException) -> None: ...


@pytest.mark.xfail(
    strict=True,
    reason="known race, not fixed: letting only the higher rank dial early (the first fix) "
    "let a stranger's claim on a name keep its worker out for the whole handshake deadline "
    "(tests/integration/test_healing.py); the fix belongs in adoption (both sides keeping "
    "the connection the lower rank dialled), see issue 38's note",
)
async def test_PeerTable_a_slow_challenge_leaves_both_sides_on_one_connection() -> None:
    tag = uuid.uuid4().hex[:8]
    paths = {0: f"\0asyncrpc-race-{tag}-0", 1: f"\0asyncrpc-race-{tag}-1"}
    addresses = {
        r: PeerAddress(f"w{r}", r, "127.0.0.1", 1, None, None, p) for r, p in paths.items()
    }
    low, high = Side("w0", 0, addresses), Side("w1", 1, addresses)
    servers = [
        await start_unix_server(paths[0], lambda: low.connection(False)),
        await start_unix_server(paths[1], lambda: high.connection(False)),
    ]
    try:
        # The higher rank dials first and is slow to read the lower rank's answer.
        high.hold_reply = True
        high_call = asyncio.ensure_future(high.table.connection(0))
        await asyncio.wait_for(low.hello_seen.wait(), 5)  # the lower rank is challenged
        low_call = asyncio.ensure_future(low.table.connection(1))
        # A dial of the lower rank's would reach the higher one within its quarter second;
        # the held answer is read right behind that Hello (or after 1 s if none comes).
        await asyncio.sleep(1.0)
        high.release()
        conns = await asyncio.wait_for(asyncio.gather(low_call, high_call), 5)
        await asyncio.sleep(0.5)  # a wrongly kept second connection is closed by now
        low_conn, high_conn = low.table.peers[1].conn, high.table.peers[0].conn
        assert low_conn is not None
        assert high_conn is not None
        assert not low_conn.closed
        assert not high_conn.closed
        assert conns[0] is low_conn
        assert conns[1] is high_conn
        # The same socket: what one side writes on its connection, the other reads.
        assert low_conn.initiated != high_conn.initiated
        assert low.adopted_closed == []
        assert high.adopted_closed == []
    finally:
        for side in (low, high):
            for peer in side.table.peers.values():
                if peer.conn is not None:
                    peer.conn.close()
        for server in servers:
            server.close()
        await asyncio.sleep(0.05)
