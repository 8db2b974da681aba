"""The connections of one agent: one multiplexed connection per peer (layer L2).

Connections open lazily on first use. A connection starts with an authenticated handshake:
the dialer's Hello (protocol version, identity, nonce), the acceptor's HelloReply (its
nonce and its proof of the group key), the dialer's Auth (its proof); see
``asyncrpc/protocol/auth.py``. A connection is adopted as the peer's only when the other
side has proven the key: the dialer on a valid HelloReply, the acceptor on a valid Auth.
Until then the connection takes handshake frames only, under small limits, and nothing is
unpickled. When two workers dial each other at the same moment, both apply one rule, so
exactly one connection survives: the one dialled by the lower rank. No request is ever
sent before the handshake, so the losing connection carries nothing and is simply closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Callable

from asyncrpc.errors import (
    AuthenticationError,
    PeerLostError,
    PeerUnavailableError,
    RemoteProtocolError,
)
from asyncrpc.protocol import auth
from asyncrpc.protocol.wire import PROTOCOL_VERSION, encode_frame
from asyncrpc.protocol.wire.messages import Auth, Hello, HelloReply
from asyncrpc.runtime.rendezvous import PeerAddress
from asyncrpc.runtime.transport import Connection, open_connection, open_unix_connection

__all__ = ["Peer", "PeerTable"]

_log = logging.getLogger("asyncrpc.runtime.peers")


class Peer:
    """What this agent knows of one other worker."""

    __slots__ = ("address", "conn", "dialing", "lost", "ready")

    def __init__(self, address: PeerAddress) -> None:
        self.address = address
        self.conn: Connection | None = None
        self.ready: asyncio.Future[Connection] | None = None
        self.dialing = False
        self.lost: BaseException | None = None


def send_message(conn: Connection, message: Hello | HelloReply | Auth) -> None:
    conn.send(encode_frame(message.to_fields(), b""))


class PeerTable:
    """Peers by rank, their connections, and the handshake rules."""

    def __init__(
        self,
        name: str,
        rank: int,
        addresses: dict[int, PeerAddress],
        make_connection: Callable[[bool], Connection],
        key: bytes,
        max_frame_size: int,
        on_auth_failure: Callable[[Connection, AuthenticationError], None],
        connect_timeout: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
        host_id: str | None = None,
    ) -> None:
        self.name = name
        self.rank = rank
        self._make_connection = make_connection
        self._key = key
        self._max_frame_size = max_frame_size
        self._on_auth_failure = on_auth_failure
        self.connect_timeout = connect_timeout
        self._ssl = ssl_context  # mutual TLS for the connections this side dials
        self._host_id = host_id  # this host, when peers on it may be reached by Unix socket
        self.peers = {r: Peer(a) for r, a in addresses.items() if r != rank}
        # Dialled connections awaiting their HelloReply: the rank they should reach and
        # the nonce this side sent.
        self._handshakes: dict[Connection, tuple[asyncio.Future[HelloReply], int, bytes]] = {}
        # Accepted connections awaiting the dialer's Auth: its rank, the proof expected and
        # the largest frame it takes.
        self._challenges: dict[Connection, tuple[int, bytes, int]] = {}

    async def connection(self, rank: int) -> Connection:
        """Return the live connection to ``rank``, dialling it first if needed.

        Cancelling the wait does not stop a dial in progress; later callers share it.

        Raises:
            PeerLostError: the peer was connected once and is gone.
            PeerUnavailableError: it cannot be reached.
        """
        peer = self.peers[rank]
        if peer.conn is not None and not peer.conn.closed:
            return peer.conn
        if peer.lost is not None:
            raise peer.lost
        if peer.ready is None or peer.ready.done():
            peer.ready = asyncio.get_running_loop().create_future()
            # Dialling from now on, not from when the task first runs: a Hello that
            # arrives in between must meet the tie-break, or both connections survive.
            peer.dialing = True
            asyncio.get_running_loop().create_task(self._dial(peer, rank))
        try:
            return await asyncio.wait_for(asyncio.shield(peer.ready), self.connect_timeout)
        except TimeoutError:
            raise PeerUnavailableError(
                peer.address.name, f"no connection within {self.connect_timeout:g} s"
            ) from None

    async def _dial(self, peer: Peer, rank: int) -> None:
        address = peer.address
        try:
            conn = await self._open(address)
            waiter = asyncio.get_running_loop().create_future()
            nonce = auth.new_nonce()
            self._handshakes[conn] = (waiter, rank, nonce)
            hello = Hello(PROTOCOL_VERSION, self.name, self.rank, nonce, self._max_frame_size)
            send_message(conn, hello)
            reply = await asyncio.wait_for(waiter, self.connect_timeout)
        except (OSError, TimeoutError, ConnectionError, RemoteProtocolError) as exc:
            self._dial_failed(peer, PeerUnavailableError(address.name, str(exc) or repr(exc)))
            return
        finally:
            peer.dialing = False
        if reply.accepted:
            return  # adopted by on_hello_reply already
        if peer.conn is None and reply.reason != _TIE_BREAK:
            conn.close()
            self._dial_failed(peer, PeerUnavailableError(address.name, reply.reason))
        else:
            # The peer keeps the connection it dialled to us; it is adopted (or will be)
            # when its Hello reaches us, which resolves ``peer.ready``.
            conn.close()

    async def _open(self, address: PeerAddress) -> Connection:
        """The Unix socket of a peer on this host if it answers, else TCP (TLS if set)."""
        factory = functools.partial(self._make_connection, True)
        if address.unix_path and self._host_id and address.host_id == self._host_id:
            try:
                return await open_unix_connection(address.unix_path, factory)
            except OSError as exc:  # same kernel, other container or network namespace
                _log.debug("Unix socket of %s: %s; using TCP", address.name, exc)
        return await open_connection(address.host, address.port, factory, self._ssl)

    def _dial_failed(self, peer: Peer, exc: BaseException) -> None:
        _log.debug("dial to %s failed: %s", peer.address.name, exc)
        if peer.ready is not None and not peer.ready.done():
            peer.ready.set_exception(exc)
            peer.ready.exception()  # mark retrieved: waiters may all have given up
        peer.ready = None  # a later call may try again

    def adopt(self, peer: Peer, rank: int, conn: Connection, peer_max_frame: int) -> None:
        conn.open(self._max_frame_size)  # authenticated: the handshake's limits are lifted
        conn.peer_max_frame = peer_max_frame  # what we send is checked against it
        conn.peer = rank
        conn.peer_name = peer.address.name
        peer.conn = conn
        if peer.ready is None or peer.ready.done():
            peer.ready = asyncio.get_running_loop().create_future()
        peer.ready.set_result(conn)
        _log.debug("%s connected to %s", self.name, peer.address.name)

    def on_hello(self, conn: Connection, hello: Hello) -> None:
        """Answer a dialer: refuse it, or challenge it (adopted once its Auth proves the key)."""
        reason = self._refusal(hello)
        if reason is not None:
            send_message(conn, HelloReply(PROTOCOL_VERSION, self.name, self.rank, False, reason))
            if reason != _TIE_BREAK:
                _log.warning("refused a connection claiming to be %r: %s", hello.name, reason)
                conn.close()
            return
        nonce = auth.new_nonce()
        dialer, me = (hello.name, hello.rank), (self.name, self.rank)
        mine = auth.proof(self._key, auth.ACCEPTOR, hello.nonce, nonce, dialer, me)
        expected = auth.proof(self._key, auth.DIALER, hello.nonce, nonce, dialer, me)
        self._challenges[conn] = (hello.rank, expected, hello.max_frame_size)
        reply = HelloReply(
            PROTOCOL_VERSION, self.name, self.rank, True, "", nonce, mine, self._max_frame_size
        )
        send_message(conn, reply)

    def on_auth(self, conn: Connection, message: Auth) -> None:
        """The dialer's proof: adopt its connection, or refuse it."""
        entry = self._challenges.pop(conn, None)
        if entry is None:
            conn.abort(RemoteProtocolError("Auth without an accepted Hello"))
            return
        rank, expected, peer_max_frame = entry
        peer = self.peers[rank]
        if not auth.verify(expected, message.proof):
            error = AuthenticationError(f"a dialer claiming to be {peer.address.name!r} "
                                        "gave a wrong proof of the group key")  # fmt: skip
            self._on_auth_failure(conn, error)
            return
        if peer.conn is not None and not peer.conn.closed:
            conn.close()  # another authenticated connection won the race
            return
        self.adopt(peer, rank, conn, peer_max_frame)

    def _refusal(self, hello: Hello) -> str | None:
        if hello.version != PROTOCOL_VERSION:
            return (
                f"protocol version {hello.version} is not supported "
                f"(this side speaks {PROTOCOL_VERSION})"
            )
        peer = self.peers.get(hello.rank)
        if peer is None or peer.address.name != hello.name:
            return f"no worker named {hello.name!r} has rank {hello.rank} in this group"
        if peer.conn is not None and not peer.conn.closed:
            return "already connected"
        if peer.dialing and self.rank < hello.rank:
            return _TIE_BREAK
        return None

    def on_hello_reply(self, conn: Connection, reply: HelloReply) -> None:
        entry = self._handshakes.pop(conn, None)
        if entry is None:
            conn.abort(RemoteProtocolError("unexpected HelloReply"))
            return
        waiter, rank, nonce = entry
        if reply.accepted:
            peer = self.peers[rank]
            if reply.rank != rank or reply.name != peer.address.name:
                conn.abort(RemoteProtocolError(f"dialled rank {rank}, rank {reply.rank} answered"))
                return
            me, acceptor = (self.name, self.rank), (reply.name, reply.rank)
            expected = auth.proof(self._key, auth.ACCEPTOR, nonce, reply.nonce, me, acceptor)
            if not auth.verify(expected, reply.proof):
                error = AuthenticationError(
                    f"{peer.address.name!r} gave a wrong proof of the group key"
                )
                self._on_auth_failure(conn, error)
                if not waiter.done():
                    waiter.set_exception(error)
                return
            proof = auth.proof(self._key, auth.DIALER, nonce, reply.nonce, me, acceptor)
            send_message(conn, Auth(proof))
            # Adopt now, not in the dial task: the peer may send a request right behind its
            # reply, and it can be in the same read as the reply itself.
            self.adopt(peer, rank, conn, reply.max_frame_size)
        if not waiter.done():
            waiter.set_result(reply)

    def on_lost(self, conn: Connection, exc: BaseException | None) -> int | None:
        """Forget ``conn``; return its peer's rank when it was that peer's live connection."""
        entry = self._handshakes.pop(conn, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(exc or ConnectionResetError("connection closed in handshake"))
        self._challenges.pop(conn, None)
        rank = conn.peer
        if rank is None:
            return None
        peer = self.peers[rank]
        if peer.conn is not conn:
            return None
        peer.conn = None
        reason = "the worker shut down" if conn.goodbye else f"connection lost ({exc or 'EOF'})"
        peer.lost = PeerLostError(peer.address.name, reason)
        return rank

    def is_lost(self, rank: int) -> bool:
        return self.peers[rank].lost is not None


_TIE_BREAK = "both sides dialled; the connection dialled by the lower rank is kept"
