"""asyncio tests of how PeerTable dials: a peer on this host by its Unix socket, falling
back to TCP when nothing answers there (another container or network namespace)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.runtime.peers import PeerTable
from asyncrpc.runtime.rendezvous import PeerAddress, this_host_id
from asyncrpc.runtime.transport import Connection, start_server, start_unix_server

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
        conn = await table(address, this_host_id())._open(address)
        assert conn.is_unix
        conn.close()
        other_host = await table(address, "another/host")._open(address)
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
        conn = await table(address, this_host_id())._open(address)
        assert not conn.is_unix
        conn.close()
    finally:
        tcp.close()
        await asyncio.sleep(0)
