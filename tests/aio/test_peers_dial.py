"""asyncio tests of how PeerTable dials: a peer on this host by its Unix socket, falling
back to TCP when nothing answers there (another container or network namespace); what
counts as evidence that a peer is dead (refusals) and what does not (resets)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.errors import PeerLostError, PeerUnavailableError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.runtime.group.rendezvous import this_host_id
from asyncrpc.runtime.net.peers import PeerTable
from asyncrpc.runtime.net.transport import Connection, start_server, start_unix_server
from asyncrpc.testing import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class Sink:
    def on_frame(self, conn: Any, frame: Any) -> None: ...

    def on_connection_lost(self, conn: Any, exc: Any) -> None: ...

    def on_protocol_error(self, conn: Any, exc: Any) -> None: ...


def connection(initiated: bool = False) -> Connection:
    return Connection(Sink(), FrameDecoder(), initiated=initiated)


def table(address: PeerAddress, host_id: str | None) -> PeerTable:
    return PeerTable(
        "me", 0, {1: address}, connection, b"k", 1 << 20, lambda c, e: None, host_id=host_id
    )


async def test_PeerTable_dials_a_same_host_peer_by_its_unix_socket() -> None:
    path = "\0asyncrpc-test-dial-unix"
    server = await start_unix_server(path, connection)
    tcp, port = await start_server("127.0.0.1", connection)
    try:
        address = PeerAddress("peer", 1, "127.0.0.1", port, None, this_host_id(), path)
        conn = await table(address, this_host_id())._open(address, lambda: connection(True))
        assert conn.is_unix
        conn.close()
        other_host = await table(address, "another/host")._open(address, lambda: connection(True))
        assert not other_host.is_unix  # not on this host: TCP
        other_host.close()
    finally:
        server.close()
        tcp.close()
        await asyncio.sleep(0)


async def test_PeerTable_falls_back_to_tcp_when_the_unix_socket_is_not_there() -> None:
    tcp, port = await start_server("127.0.0.1", connection)
    try:
        address = PeerAddress("peer", 1, "127.0.0.1", port, None, this_host_id(), "\0nobody")
        conn = await table(address, this_host_id())._open(address, lambda: connection(True))
        assert not conn.is_unix
        conn.close()
    finally:
        tcp.close()
        await asyncio.sleep(0)


async def test_PeerTable_declares_lost_a_peer_whose_address_refuses() -> None:
    address = PeerAddress("peer", 1, "127.0.0.1", free_port(), None, None, None)
    peers = table(address, None)
    with pytest.raises(PeerLostError, match="refused"):
        await peers.connection(1)
    assert peers.is_lost(1)
    with pytest.raises(PeerLostError):  # for good: no new dial
        await peers.connection(1)


async def test_PeerTable_reset_in_the_handshake_is_not_evidence_of_death() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # a middlebox (or a restarting peer) that resets every connection

    class Router(Sink):  # what the agent does: a lost connection goes to the table
        def on_connection_lost(self, conn: Any, exc: Any) -> None:
            peers.on_lost(conn, exc)

    def routed(initiated: bool) -> Connection:
        return Connection(Router(), FrameDecoder(), initiated=initiated)

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        address = PeerAddress("peer", 1, "127.0.0.1", port, None, None, None)
        peers = PeerTable("me", 0, {1: address}, routed, b"k", 1 << 20, lambda c, e: None)
        with pytest.raises(PeerUnavailableError):
            await peers.connection(1)
        assert not peers.is_lost(1)  # a later call dials again
    finally:
        server.close()
        await asyncio.sleep(0)
