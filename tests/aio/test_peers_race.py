"""asyncio tests of two PeerTables dialling each other at once over real Unix sockets: the
handshake's rule that exactly one connection survives, also when one side is slow to read.

The 64-worker all-to-all once lost a call to "Broken pipe" under a load of 40: the lower
rank, challenged by the higher rank's dial for longer than a quarter of a second, dialled
too; the higher rank accepted that dial and then adopted its own, so each side adopted a
different connection and then closed the other's, with requests already written on them.
Now the higher rank holds its own dial back while the lower rank's is challenged, until
the peer's Pong (it adopted ours) or its Auth (it adopted its own, which wins).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.wire import PROTOCOL_VERSION, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Auth, Hello, HelloReply, Ping, Pong, decode_message
from asyncrpc.runtime.net.peers import PeerTable
from asyncrpc.runtime.net.transport import Connection, open_unix_connection, start_unix_server

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]


class Side:
    """One worker's peer table with the part of the network that feeds its handshakes;
    ``hold_reply`` delays the HelloReply of its own dial until ``release`` (a slow reader),
    which comes right behind the first message of kind ``release_on`` it reads."""

    def __init__(self, name: str, rank: int, addresses: dict[int, PeerAddress]) -> None:
        self.table = PeerTable(
            name, rank, addresses, self.connection, b"key", 1 << 20, lambda c, e: c.abort(e),
            dial=self.dial,
        )  # fmt: skip
        self.hold_reply = False
        self.release_on: type[Any] = Hello
        self.held: list[Callable[[], None]] = []
        self.adopted_closed: list[Connection] = []  # adopted, then closed under this side
        self.hello_seen = asyncio.Event()
        self.ponged = asyncio.Event()

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
        if conn.peer is not None:  # nothing but handshakes and Pings in these tests
            if isinstance(message, Ping):
                conn.send(encode_frame(Pong().to_fields(), b""))
            elif isinstance(message, Pong):
                self.table.on_pong(conn)
                self.ponged.set()
            return
        if isinstance(message, HelloReply) and self.hold_reply:
            self.held.append(lambda: self.table.on_handshake(conn, message))
            return
        self.table.on_handshake(conn, message)
        if isinstance(message, Hello):
            self.hello_seen.set()
        if self.hold_reply and isinstance(message, self.release_on):
            self.release()  # the held answer is read right behind this message

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        if conn.peer is not None:
            self.adopted_closed.append(conn)
        self.table.on_lost(conn, exc)

    def on_protocol_error(self, conn: Connection, exc: BaseException) -> None: ...


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[Side, Side]]:
    """Workers w0 and w1 on abstract Unix sockets; every connection closed at the end."""
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
        yield low, high
    finally:
        for side in (low, high):
            for peer in side.table.peers.values():
                for conn in (peer.conn, peer.tentative):
                    if conn is not None:
                        conn.close()
        for server in servers:
            server.close()
        await asyncio.sleep(0.05)


async def assert_one_connection(low: Side, high: Side, conns: list[Connection]) -> None:
    """Both sides hold the two ends of one live socket, and nothing adopted was closed."""
    await asyncio.sleep(0.5)  # a wrongly kept second connection is closed by now
    low_conn, high_conn = low.table.peers[1].conn, high.table.peers[0].conn
    assert low_conn is not None
    assert high_conn is not None
    assert not low_conn.closed
    assert not high_conn.closed
    assert conns[0] is low_conn
    assert conns[1] is high_conn
    assert low_conn.initiated != high_conn.initiated
    assert low.adopted_closed == []
    assert high.adopted_closed == []
    # The same socket: what one side writes on its connection, the other reads.
    for side, conn in ((low, low_conn), (high, high_conn)):
        conn.send(encode_frame(Ping().to_fields(), b""))
        await asyncio.wait_for(side.ponged.wait(), 5)


async def test_PeerTable_a_slow_challenge_leaves_both_sides_on_one_connection() -> None:
    async with pair() as (low, high):
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
        await assert_one_connection(low, high, conns)


async def test_PeerTable_a_race_won_at_the_peer_by_the_higher_ranks_dial_keeps_that_one() -> None:
    async with pair() as (low, high):
        # As above, but the lower rank reads the higher rank's Auth before the answer to
        # its own dial: it adopts the higher rank's dial first, which both then keep.
        high.hold_reply = True
        high_call = asyncio.ensure_future(high.table.connection(0))
        await asyncio.wait_for(low.hello_seen.wait(), 5)
        low.hold_reply, low.release_on = True, Auth
        low_call = asyncio.ensure_future(low.table.connection(1))
        conns = await asyncio.wait_for(asyncio.gather(low_call, high_call), 5)
        assert conns[1].initiated  # the higher rank's dial: its Ping was answered
        assert high.ponged.is_set()
        await assert_one_connection(low, high, conns)


async def test_PeerTable_a_strangers_claim_holds_back_the_higher_ranks_dial_one_round_trip() -> (
    None
):
    async with pair() as (low, high):
        # A stranger claims w0 at w1 and stays silent: w1 challenges it, awaiting an Auth.
        path = low.table.peers[1].address.unix_path  # w1's socket
        assert path is not None
        reader, writer = await asyncio.open_unix_connection(path)
        hello = Hello(PROTOCOL_VERSION, "w0", 0, auth.new_nonce())
        writer.write(b"".join(bytes(p) for p in encode_frame(hello.to_fields(), b"")))
        await asyncio.wait_for(reader.read(65536), 5)  # its challenge
        try:
            assert high.table._challenged(0)
            # w1 dials w0: its dial is held back (the claim could be w0's own dial) only
            # until w0's Pong, not until the claim's handshake deadline.
            started = asyncio.get_running_loop().time()
            conn = await asyncio.wait_for(high.table.connection(0), 5)
            assert asyncio.get_running_loop().time() - started < 1.0
            assert conn.initiated
            assert high.ponged.is_set()  # held back until w0's Pong said it adopted it
            assert high.table._challenged(0)  # the claim is still open
            await assert_one_connection(low, high, [low.table.peers[1].conn, conn])
        finally:
            writer.close()
