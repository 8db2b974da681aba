"""The worker's listening sockets, open from before the group is joined (layer L2.2).

A worker must listen before the rendezvous (its address is what it publishes), but its
network exists only once the group is joined. Until then the listener parks what it
accepts: each connection, with the first few frames it sends, in order. ``attach`` hands
them, and every later connection, to the network. Parked frames are only kept, never read:
nothing is unpickled or answered before the network takes over.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from asyncrpc.errors import ProtocolError, RemoteProtocolError
from asyncrpc.protocol.handshake import pre_auth_decoder
from asyncrpc.protocol.wire import Frame, bytearray_allocator
from asyncrpc.runtime.net.tls import TlsContexts
from asyncrpc.runtime.net.transport import (
    Connection,
    ConnectionHandler,
    start_server,
    start_unix_server,
)

__all__ = ["Acceptor", "Listener", "Parked"]

# The acceptor's side of a handshake is two frames (Hello, then Auth); a connection that
# sends more before the join is not following the protocol.
_MAX_PARKED_FRAMES = 2


@dataclass(slots=True)
class Parked:
    """A connection accepted before the join: when, and the frames it sent since."""

    since: float
    frames: list[Frame] = field(default_factory=list)


class Acceptor(ConnectionHandler, Protocol):
    """What takes the listener's connections once the group is joined (the network)."""

    def allocate(self, conn: Connection, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """The memory a segment received on ``conn`` lands in."""

    def accept(self) -> Connection:
        """Make the connection for a socket accepted from now on."""

    def take_parked(self, conn: Connection, parked: Parked) -> None:
        """Take over a connection accepted before, and the frames it sent meanwhile."""


class Listener:
    """The TCP (and, on Linux, abstract Unix) sockets of one worker."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._servers: list[asyncio.AbstractServer] = []
        self.port = 0
        self.unix_path: str | None = None  # None: the worker takes no Unix connections
        self._parked: dict[Connection, Parked] = {}
        self._acceptor: Acceptor | None = None  # None until the group is joined

    @classmethod
    async def start(
        cls, host: str, port: int, tls: TlsContexts | None, unix_sockets: bool
    ) -> Listener:
        """Listen on ``host:port`` (0: a free port), TLS if given, and a Unix socket on Linux
        when ``unix_sockets`` (never with TLS). Cancelling it closes what was opened.

        Raises:
            OSError: the address cannot be bound.
        """
        listener = cls(asyncio.get_running_loop())
        try:
            server, listener.port = await start_server(
                host, listener._accept, port, ssl_context=tls.server if tls else None
            )
            listener._servers.append(server)
            if unix_sockets and tls is None and sys.platform == "linux":
                # Abstract namespace (leading NUL): nothing to clean up, even after a SIGKILL.
                path = f"\0asyncrpc-{uuid.uuid4().hex}"
                listener._servers.append(await start_unix_server(path, listener._accept))
                listener.unix_path = path
        except BaseException:
            listener.close()
            raise
        return listener

    def _accept(self) -> Connection:
        if self._acceptor is not None:
            return self._acceptor.accept()
        # The decoder outlives the parking: its segments land where the network says.
        conn = Connection(
            self, pre_auth_decoder(lambda n, tag: self._allocate(conn, n, tag)), initiated=False
        )
        self._parked[conn] = Parked(self._loop.time())
        return conn

    def _allocate(self, conn: Connection, nbytes: int, tag: str) -> tuple[object, memoryview]:
        if self._acceptor is not None:
            return self._acceptor.allocate(conn, nbytes, tag)
        return bytearray_allocator(nbytes, tag)

    def attach(self, acceptor: Acceptor) -> None:
        """Hand the parked connections (in the order they came) and all later ones over."""
        self._acceptor = acceptor
        parked, self._parked = self._parked, {}
        for conn, entry in parked.items():
            conn.hand_over(acceptor)
            if not conn.closed:
                acceptor.take_parked(conn, entry)

    def close(self) -> None:
        """Stop listening; parked connections are closed (accepted ones are the network's)."""
        for server in self._servers:
            server.close()
        for conn in list(self._parked):
            conn.close()

    # -- the handler of parked connections (asyncrpc.runtime.net.transport) ----------------

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        entry = self._parked.get(conn)
        if entry is None:
            return
        if len(entry.frames) >= _MAX_PARKED_FRAMES:
            conn.abort(RemoteProtocolError("too many frames before the handshake"))
            return
        entry.frames.append(frame)

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        self._parked.pop(conn, None)

    def on_protocol_error(self, conn: Connection, exc: ProtocolError) -> None:
        self._parked.pop(conn, None)
