"""The network of one worker: its connections, one authenticated connection per peer,
frames in order across reconnects, liveness, and calls to self (layer L2.2).

It is built once the group is joined, from the group, the options, the loop, the
allocator of receive memory and the listener, and takes over the listener's connections.
It runs each connection's handshake (through ``PeerTable``), answers the frames that are
its own (Ping, Pong, Goodbye, and the shared-memory bookkeeping of the ``SharedMemory``
it owns), and hands every other authenticated frame to its ``Receiver`` (the agent),
which also hears when a connection or a peer is lost and what became of the RRef forks
frames carried. It is the ``Frames`` port (``runtime/ports.py``): frames leave through
``send`` (connect first if needed, in order: ``links.py``), ``write`` (on a given
connection) and ``control`` (only if connected; to this worker through the loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from asyncrpc.errors import (
    AuthenticationError,
    ConnectionLostError,
    PeerLostError,
    RemoteProtocolError,
    UnknownWorkerError,
)
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.handshake import pre_auth_decoder
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.protocol.wire import Allocator, Frame, encode_frame
from asyncrpc.protocol.wire.messages import (
    Auth,
    Cancel,
    Goodbye,
    Hello,
    HelloReply,
    Idle,
    Kind,
    Pong,
    ShmMessage,
    decode_message,
)
from asyncrpc.runtime.metrics import Counters, RateLimitedLog
from asyncrpc.runtime.net.heartbeat import Heartbeat, Watched
from asyncrpc.runtime.net.idle import IdleCloser
from asyncrpc.runtime.net.links import ForkEvents, Links
from asyncrpc.runtime.net.listener import Listener, Parked
from asyncrpc.runtime.net.loopback import LoopbackConnection
from asyncrpc.runtime.net.peers import GOODBYE_REASON, Dial, PeerTable, without_goodbye
from asyncrpc.runtime.net.tls import TlsContexts
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.ports import OutgoingFrame
from asyncrpc.runtime.shm.shm import SHM_TAG_PREFIX, SharedMemory

__all__ = ["Members", "Network", "Receiver"]

_log = logging.getLogger(__name__)
_OWN_KINDS = frozenset({Kind.PING, Kind.PONG, Kind.GOODBYE, Kind.SHM, Kind.IDLE})


def _never(rank: int) -> bool:
    return False


class Members(Protocol):
    """What the network reads of the group it connects (``asyncrpc.runtime.group.Group``)."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def addresses(self) -> dict[int, PeerAddress]: ...
    @property
    def key(self) -> bytes: ...
    @property
    def tls(self) -> TlsContexts | None: ...
    @property
    def lazy(self) -> bool:
        """Whether members not met yet are looked up (then ``lookup`` reads them)."""

    @property
    def host_id(self) -> str | None: ...

    def same_host(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host (it may share memory with this worker)."""

    async def lookup(self, rank: int) -> None:
        """Learn ``rank``'s address if it is a member not met yet."""


class Receiver(ForkEvents, Protocol):
    """What the network tells the part above it (the agent), on the loop thread."""

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """An authenticated frame that is not the network's own."""

    def on_connection_lost(self, rank: int, conn: Connection, error: PeerLostError) -> None:
        """``conn`` to ``rank`` closed: what was written on it may be lost."""

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good."""

    def busy_peers(self) -> set[int]:
        """The ranks this worker has something in flight with: calls waiting for their
        reply, requests of theirs running here (an idle connection to any other may be
        closed: ``idle.py``)."""


class Network:
    """The connections of one worker, on its loop thread."""

    def __init__(
        self,
        members: Members,
        options: RpcBackendOptions,
        loop: asyncio.AbstractEventLoop,
        counters: Counters,
        *,
        receiver: Receiver,
        allocate: Allocator,
        listener: Listener,
        dial: Dial | None = None,
    ) -> None:
        self.members, self.rank, self.loop = members, members.rank, loop
        self.addresses = members.addresses
        self.counters = counters
        self._options, self._receiver, self._allocate = options, receiver, allocate
        self._listener = listener
        self._auth_log = RateLimitedLog(_log, interval=10.0)
        self.connections: set[Connection] = set()
        self.closed = False
        # This worker is leaving (its shutdown has begun, or its program is ending): a
        # lost connection is then not followed by "the next call reconnects".
        self.leaving = False
        self.peers = PeerTable(
            members.name, members.rank, members.addresses, self._new_connection, members.key,
            options.max_frame_size, self._refuse,
            ssl_context=members.tls.client if members.tls else None, host_id=members.host_id,
            on_adopted=self._on_adopted, on_declared_lost=self._on_declared_lost, dial=dial,
        )  # fmt: skip
        # Same-host memory for large tensors: its bookkeeping rides on this network.
        self.shm = SharedMemory(
            loop, options.shm_threshold, options.shm_arena_bytes,
            members.same_host if options.shared_memory else _never, self.control,
        )  # fmt: skip
        self.loopback = LoopbackConnection(
            members.rank, members.name, loop, allocate, self.on_frame
        )
        self.links = Links(
            members.rank, loop, counters, self.peers, self.loopback, self.shm,
            members.addresses, receiver, self.peer_known, self.know_peer,
        )  # fmt: skip
        self.heartbeat = Heartbeat(
            loop, options.heartbeat_interval, options.heartbeat_timeout,
            lambda: self.connections, self.links.ping, self._silent, self.links.ask_acks,
            silent_limit=options.silent_link_timeout,
        )  # fmt: skip
        self.idle = IdleCloser(
            loop, options.idle_timeout, lambda: self.connections, self.peers,
            self._busy_peers, self.links.unacked,
        )  # fmt: skip

    def start(self) -> None:
        """Take the listener's connections (parked ones first) and start the heartbeat."""
        self._listener.attach(self)
        self.heartbeat.start()
        self.idle.start()

    # -- connections -----------------------------------------------------------------------

    def accept(self) -> Connection:
        return self._new_connection(False)

    def take_parked(self, conn: Connection, parked: Parked) -> None:
        self._track(conn, parked.since)
        for frame in parked.frames:
            if conn.closed:
                return
            self.on_frame(conn, frame)

    def _new_connection(self, initiated: bool) -> Connection:
        # Until the peer proves the key: handshake frames only, small, one per read pass
        # (PeerTable.adopt lifts the limits), and a deadline for accepted connections.
        conn = Connection(
            self, pre_auth_decoder(lambda n, tag: self.allocate(conn, n, tag)), initiated=initiated
        )
        self._track(conn, None if initiated else self.loop.time())
        return conn

    def _track(self, conn: Connection, accepted_at: float | None) -> None:
        self.connections.add(conn)
        self.counters.connections_opened += 1
        if accepted_at is not None:
            deadline = accepted_at + self._options.handshake_timeout
            self.loop.call_at(deadline, self._handshake_deadline, conn)

    def allocate(self, conn: Connection, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """Receive memory for a segment: a fresh buffer, or the sender's shared chunk."""
        if tag.startswith(SHM_TAG_PREFIX):
            return self.shm.allocate(conn.peer, nbytes, tag)
        return self._allocate(nbytes, tag)

    def _handshake_deadline(self, conn: Connection) -> None:
        # Idle, or stalled in the middle of its Hello or Auth: closed either way.
        if conn.peer is None and not conn.closed:
            self.counters.handshake_timeouts += 1
            limit = self._options.handshake_timeout
            self._refuse(
                conn, AuthenticationError(f"no authenticated handshake within {limit:g} s")
            )

    def _refuse(self, conn: Connection, error: AuthenticationError) -> None:
        """A connection failed to authenticate: count it, log it (rate-limited), close it."""
        self.counters.auth_failures += 1
        self._auth_log.warning("worker %r refused a connection: %s", self.members.name, error)
        conn.abort(error)

    def _silent(self, conn: Watched, seconds: float, reason: str) -> None:
        assert isinstance(conn, Connection)
        self.counters.silent_connections += 1
        if conn.mid_frame:
            self.counters.stalled_frames += 1
            reason += " (in the middle of a frame)"
        if conn.peer is not None:
            # Evidence that the peer is gone, not only this connection: declared lost.
            name = self.addresses[conn.peer].name
            self.peers.declare_lost(conn.peer, PeerLostError(name, reason, "silence"))
        conn.abort(ConnectionLostError(reason))

    # -- receiving (asyncrpc.runtime.net.transport.ConnectionHandler) ----------------------

    def on_frame(self, conn: Any, frame: Frame) -> None:
        fields = frame.fields
        if conn.peer is not None and (not fields or fields[0] not in _OWN_KINDS):
            conn.frames_in += 1  # a sign of use for the idle closer (an int, no clock)
            self._receiver.on_frame(conn, frame)  # the hot path: calls and replies
            return
        message = self.decode(conn, fields)
        if message is None:
            return
        if conn.peer is None:
            self._on_handshake(conn, message)
        elif isinstance(message, Goodbye):
            conn.goodbye = True
        elif isinstance(message, Pong):
            # Its bytes were the sign of life the heartbeat looks for; it also acknowledges
            # the refcount frames sent before its Ping. On our own dial, held back while
            # the peer's might win, it proves the peer adopted it (PeerTable.adopt).
            self.peers.on_pong(conn)
            self.links.ponged(conn, conn.peer)
        elif isinstance(message, ShmMessage):
            self.shm.on_message(conn.peer, message)
        elif isinstance(message, Idle):
            self.idle.on_idle(conn, message.ask)
        else:
            self.write(conn, encode_frame(Pong().to_fields(), b""))

    def decode(self, conn: Connection, fields: list[Any]) -> Any | None:
        """The message a frame's fields hold; None when they are malformed, and then the
        connection is aborted (a protocol error, counted)."""
        try:
            return decode_message(fields)
        except RemoteProtocolError as exc:
            self.counters.protocol_errors += 1
            conn.abort(exc)
            return None

    def _on_handshake(self, conn: Connection, message: Any) -> None:
        # The handshake's rules are in asyncrpc/protocol/handshake.py; the peer table drives
        # that machine. Here: a newcomer's Hello waits for its look-up; other kinds never
        # reach the machine.
        if isinstance(message, Hello):
            if self.peer_known(message.rank) or not self.members.lazy:
                self.peers.on_handshake(conn, message)
            else:
                self.loop.create_task(self._on_newcomer_hello(conn, message))
        elif isinstance(message, (HelloReply, Auth)):
            self.peers.on_handshake(conn, message)
        else:
            self.counters.protocol_errors += 1
            conn.abort(RemoteProtocolError(f"{type(message).__name__} before the handshake"))

    async def _on_newcomer_hello(self, conn: Connection, hello: Hello) -> None:
        # A member that joined after this one dials: its address is in the store (it
        # publishes before it dials). A stranger's made-up rank costs one read, bounded by
        # the handshake deadline; it is refused by the handshake (no such member) or by its
        # proof.
        with contextlib.suppress(UnknownWorkerError):  # then refused by the handshake
            await self.know_peer(hello.rank)
        if not conn.closed:
            self.peers.on_handshake(conn, hello)

    def on_protocol_error(self, conn: Connection, exc: BaseException) -> None:
        """The peer sent bytes that break the protocol; the connection is being aborted."""
        self.counters.protocol_errors += 1

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        """A connection closed. Its peer stays reachable (the next call dials again) unless
        it is declared lost (see ``peers.py``)."""
        self.connections.discard(conn)
        rank = self.peers.on_lost(conn, exc)
        if rank is None:
            return
        peer = self.peers.peers[rank]
        if conn.idle is not None:
            self._closed_idle(rank, conn)
            return
        self.counters.connections_lost += 1
        # Forks whose frames may have died with it: ask the peer (see reflog.py).
        self.links.on_lost(rank, conn, ask=peer.lost is None and not self.closed)
        cause = f"connection lost ({exc or 'EOF'})"
        # The peer closed it unannounced: a hint of why.
        reason = cause if peer.vanished is None else without_goodbye(cause)
        self._receiver.on_connection_lost(
            rank, conn, peer.lost or PeerLostError(peer.address.name, reason)
        )
        # Shared memory ends with the connection: chunks lent on it are closed, not reused,
        # and the peer's mappings dropped; the next connection probes again.
        self.shm.on_peer_lost(rank)
        if peer.lost is None and not self.closed and peer.conn is None:
            # Dial again now, not at the next call: the link heals before it is needed, and
            # a dead peer is found (refused) and declared lost, which frees its RRefs. The
            # loss is logged once the dial has told what it was (see _redial).
            self.loop.create_task(self._redial(rank, cause))
        elif peer.lost is None:
            _log.debug("worker %r: a connection to %r closed: %s", self.members.name,
                       peer.address.name, cause)  # fmt: skip

    def _busy_peers(self) -> set[int]:
        # Asked of the receiver only when idle_timeout is on (at the closer's ticks).
        return self._receiver.busy_peers()

    def _closed_idle(self, rank: int, conn: Connection) -> None:
        """``conn`` closed after both sides agreed it was idle: nothing was in flight on
        it, so nothing failed; no redial (the next frame for ``rank`` dials)."""
        self.counters.connections_idle_closed += 1
        peer = self.peers.peers[rank]
        peer.vanished = None  # closed on purpose, though without a Goodbye
        self.links.on_lost(rank, conn, ask=False)
        self._receiver.on_connection_lost(
            rank, conn, PeerLostError(peer.address.name, "connection closed while idle")
        )
        self.shm.on_peer_lost(rank)
        _log.debug("worker %r: closed the idle connection to %r", self.members.name,
                   peer.address.name)  # fmt: skip

    def _on_adopted(self, rank: int, conn: Connection) -> None:
        self.links.on_adopted(rank, conn)

    def _on_declared_lost(self, rank: int) -> None:
        lost = self.peers.peers[rank].lost
        assert lost is not None
        if self.closed or lost.reason == GOODBYE_REASON:  # a shutdown is no news
            _log.debug("worker %r: %s", self.members.name, lost)
        else:
            _log.warning("worker %r: %s", self.members.name, lost)
        self.links.forget(rank)
        self._receiver.on_peer_lost(rank, lost)
        self.shm.on_peer_lost(rank)

    # -- peers -----------------------------------------------------------------------------

    def peer_known(self, rank: int) -> bool:
        """Whether the peer table has ``rank``, adding it if its address is known (a member
        another thread looked up); on the loop thread."""
        if rank in self.peers.peers:
            return True
        address = self.addresses.get(rank)
        if address is None or rank == self.rank:
            return False
        self.peers.add(address)
        return True

    async def know_peer(self, rank: int) -> None:
        """Make ``rank`` a peer, looking it up in the group's store if needed.

        Raises:
            UnknownWorkerError: no member has that rank.
        """
        if not self.peer_known(rank):
            await self.members.lookup(rank)
            if not self.peer_known(rank):
                names = tuple(a.name for a in self.addresses.values())
                raise UnknownWorkerError(rank, names)

    def is_lost(self, rank: int) -> bool:
        return rank in self.peers.peers and self.peers.is_lost(rank)

    def is_connected(self, rank: int) -> bool:
        return self.peers.connected(rank)

    def lost_peers(self) -> list[str]:
        return sorted(p.address.name for p in self.peers.peers.values() if p.lost is not None)

    def probe(self, rank: int) -> None:
        """Dial ``rank`` unless connected or lost: a dead peer refuses and is declared lost."""
        peer = self.peers.peers.get(rank)
        if peer is None:
            if rank != self.rank:  # a member never met: read its address first
                self.loop.create_task(self._probe_unknown(rank))
            return
        if peer.lost is None and not self.peers.connected(rank) and not peer.dialing:
            self.loop.create_task(self._redial(rank))

    async def _probe_unknown(self, rank: int) -> None:
        with contextlib.suppress(UnknownWorkerError):
            await self.know_peer(rank)
            self.probe(rank)

    async def _redial(self, rank: int, lost: str | None = None) -> None:
        """Dial ``rank`` again. After a lost connection (``lost`` says how it ended), log
        what the dial found: the peer answers again, it is gone (declared lost, which
        ``_on_declared_lost`` logs), or it cannot be reached yet."""
        name = self.peers.peers[rank].address.name
        try:
            await self.peers.connection(rank)
        except PeerLostError:
            return  # declared lost: logged there, with why
        except (ConnectionError, OSError) as exc:  # not reachable yet: nothing is proven
            if lost is None or self.closed:
                _log.debug("worker %r: redial of %r failed: %s", self.members.name, name, exc)
            elif self.leaving:
                _log.warning("worker %r: lost the connection to worker %r (%s), and this "
                             "worker is shutting down: %s", self.members.name, name, lost,
                             exc)  # fmt: skip
            else:
                _log.warning("worker %r: lost the connection to worker %r (%s): %s; the "
                             "next call reconnects", self.members.name, name, lost,
                             exc)  # fmt: skip
            return
        if lost is not None:
            _log.warning("worker %r: lost the connection to worker %r (%s); connected again",
                         self.members.name, name, lost)  # fmt: skip

    # -- sending ---------------------------------------------------------------------------

    def send(self, frame: OutgoingFrame) -> None:
        """Write ``frame`` to its peer in order, once ready and connected (see links.py)."""
        self.links.send(frame)

    def send_ref(self, rank: int, pieces: list[Any]) -> None:
        """Send a refcount frame, again on a new connection until acknowledged."""
        self.links.send_ref(rank, pieces)

    def write(
        self, conn: Any, pieces: list[Any], keep: object = None,
        forks: list[ForkPair] | None = None,
    ) -> None:  # fmt: skip
        """Write a frame on ``conn``; a closed connection drops it (the peer is gone)."""
        self.links.write(conn, pieces, keep, forks)

    def control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        """Write a bookkeeping frame to ``rank``: to this worker through the loopback, to a
        peer if it is connected, or else connecting first when ``connect``."""
        if connect or rank == self.rank:
            self.send(OutgoingFrame(rank, pieces))
            return
        peer = self.peers.peers.get(rank)
        if peer is not None and peer.conn is not None and not peer.conn.closed:
            self.write(peer.conn, pieces)

    def unsent(self, ranks: list[int]) -> bool:
        """Whether frames for any of ``ranks`` still wait for their connection here."""
        return any(self.links.waiting(rank) for rank in ranks)

    def cancel(self, rank: int, call_id: int) -> None:
        """Tell ``rank`` that ``call_id`` is over, unless its request was not written yet
        (it waits here, and will be skipped)."""
        if not self.links.holds(rank, call_id):
            # Only if connected: a new link never ran it.
            self.control(rank, encode_frame(Cancel(call_id).to_fields(), b""))

    # -- stopping and figures --------------------------------------------------------------

    def close(self, graceful: bool) -> None:
        """Stop listening and close every connection (saying Goodbye first if ``graceful``)."""
        self.closed = True
        self.heartbeat.stop()
        self.idle.stop()
        self._listener.close()
        goodbye = encode_frame(Goodbye("shutdown").to_fields(), b"")
        for conn in list(self.connections):
            if graceful and conn.peer is not None and not conn.closed:
                self.write(conn, goodbye)
            conn.close()
        self.loopback.close()
        self.shm.close()

    def statistics(self) -> dict[str, int | float]:
        # One snapshot: callers read metrics from their own thread while the loop thread
        # adds and removes connections (iterating the live set could fail mid-way).
        conns = list(self.connections)
        live = [c for c in conns if c.peer is not None and not c.closed]
        return {
            "bytes_in": sum(c.bytes_in for c in conns),
            "bytes_out": sum(c.bytes_out for c in conns),
            "open_connections": len(live),
            "open_unix_connections": sum(1 for c in live if c.is_unix),
            # silent peers whose process was probed, and probes whose silence lost a peer
            "liveness_probes": self.heartbeat.probes,
            "liveness_checked": 0 if self.heartbeat.probe is None else self.heartbeat.probe.checked,
            "probes_unanswered": self.heartbeat.probes_unanswered,
            **self.shm.stats(),
        }
