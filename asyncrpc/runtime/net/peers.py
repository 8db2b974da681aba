"""The connections of one agent: one multiplexed connection per peer (layer L2.2).

Connections open lazily on first use. A connection starts with an authenticated handshake,
whose rules live in the sans-I/O machine of ``asyncrpc/protocol/handshake.py``: this table
feeds it the handshake messages and performs its actions (send, adopt, close). A connection
is adopted as the peer's only when the other side has proven the key. Until then the
connection takes handshake frames only, under small limits, and nothing is unpickled.
When two workers dial each other at the same moment, both apply one rule, so exactly one
connection survives: the one dialled by the lower rank. No request is ever sent before
the handshake, and the higher rank writes nothing on its own dial while the lower rank's
may still win (see ``adopt``), so the losing connection carries nothing and is simply
closed.

A connection is not the peer. Losing one fails what was written on it, and the next call
dials again. A peer is declared lost (for good: its calls fail at once) only on evidence:
its address refuses connections after a few retries, it said Goodbye, or its heartbeats
stopped (the agent says so with ``declare_lost``). A stranger cannot make a worker lost: a
connection becomes a peer's only once it proves the group key.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Final

from asyncrpc.errors import (
    AuthenticationError,
    PeerLostError,
    PeerUnavailableError,
    RemoteProtocolError,
)
from asyncrpc.errorstate import own_copy
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.handshake import Action, Adopt, Close, Handshake, Refusal, Send, State
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import Auth, Hello, HelloReply, Ping
from asyncrpc.runtime.net.transport import Connection, open_connection, open_unix_connection

__all__ = [
    "DIAL_RETRY_DELAYS",
    "GOODBYE_REASON",
    "NO_GOODBYE_HINT",
    "REFUSED_RETRY_DELAYS",
    "Dial",
    "Peer",
    "PeerTable",
    "closed_by_peer",
    "without_goodbye",
]

_log = logging.getLogger(__name__)

# Opens a transport to a peer for the connection the factory makes, and returns that
# connection once it is connected: ``dial(address, factory)``. The default reaches the
# peer's Unix socket on this host, else TCP (TLS if configured); a test may hand in a
# socketpair instead.
Dial = Callable[[PeerAddress, Callable[[], Connection]], Awaitable[Connection]]

# Pauses before the retries of a dial. A peer whose address refuses connections after
# REFUSED_RETRY_DELAYS is declared lost: a dead process refuses at once, and callers must
# learn that in well under a second. Other failures (a reset in the handshake, a peer that
# has not yet seen its old connection close) prove nothing: the dial retries after each of
# DIAL_RETRY_DELAYS, then fails with PeerUnavailableError, and a later call tries again.
REFUSED_RETRY_DELAYS: Final = (0.05, 0.15)
GOODBYE_REASON: Final = "the worker shut down"  # a peer that said Goodbye: not a failure
DIAL_RETRY_DELAYS: Final = (0.05, 0.1, 0.2, 0.4, 0.8)
# What a peer that closed without a Goodbye may have done: a worker says Goodbye whenever
# it leaves through shutdown(), so its process ended some other way.
NO_GOODBYE_HINT: Final = "it crashed, or ended without calling asyncrpc.shutdown()"


def closed_by_peer(exc: BaseException | None) -> bool:
    """Whether a connection ended with ``exc`` was closed by the other side (an end of
    file or a reset), not by this side or a protocol error."""
    return exc is None or isinstance(
        exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
    )


def without_goodbye(reason: str) -> str:
    """``reason`` for a connection the peer closed unannounced, with a hint of why."""
    return f"{reason} without a Goodbye (if it is gone, {NO_GOODBYE_HINT})"


class Peer:
    """What this agent knows of one other worker."""

    __slots__ = ("address", "conn", "dialing", "lost", "ready", "tentative", "vanished")

    def __init__(self, address: PeerAddress) -> None:
        self.address = address
        self.conn: Connection | None = None
        self.ready: asyncio.Future[Connection] | None = None
        self.dialing = False
        # Our own dial, authenticated, held back while the peer's may still win (``adopt``).
        self.tentative: Connection | None = None
        self.lost: PeerLostError | None = None
        # How its last connection ended when the peer closed it without a Goodbye ("EOF",
        # a reset); None once a new connection is adopted. A dial that is then refused
        # says its process has ended, and how.
        self.vanished: str | None = None


def send_message(conn: Connection, message: Hello | HelloReply | Auth | Ping) -> None:
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
        on_adopted: Callable[[int, Connection], None] | None = None,
        on_declared_lost: Callable[[int], None] | None = None,
        dial: Dial | None = None,
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
        self._on_adopted = on_adopted
        self._on_declared_lost = on_declared_lost
        self._dial_transport = self._open if dial is None else dial
        self.peers = {r: Peer(a) for r, a in addresses.items() if r != rank}
        # Connections in their handshake, and for dialled ones the dial's waiter: told the
        # refusal (NONE: adopted, or another connection won) or the error.
        self._handshakes: dict[Connection, tuple[Handshake, asyncio.Future[Close] | None]] = {}

    def add(self, address: PeerAddress) -> None:
        """Know one more worker: a dynamic group's member met after this table was made."""
        if address.rank != self.rank and address.rank not in self.peers:
            self.peers[address.rank] = Peer(address)

    async def connection(self, rank: int) -> Connection:
        """Return the live connection to ``rank``, dialling it first if needed.

        Cancelling the wait does not stop a dial in progress; later callers share it.

        Raises:
            PeerLostError: the peer is declared lost (see the module's docstring).
            PeerUnavailableError: it cannot be reached now.
        """
        peer = self.peers[rank]
        if peer.conn is not None and not peer.conn.closed:
            return peer.conn
        if peer.lost is not None:
            raise own_copy(peer.lost)  # kept for good: each raise gets its own copy
        if peer.ready is None or peer.ready.done():
            peer.ready = asyncio.get_running_loop().create_future()
            if not self._challenged(rank):
                self._start_dial(peer, rank)
            else:
                # The peer is dialling us: its Auth will resolve ``ready`` within a round
                # trip, and dialling too could leave each side with a different connection.
                # If that handshake fails (or is a stranger's), we dial: at once when it
                # closes, at the latest after _CHALLENGE_WAIT_S.
                loop = asyncio.get_running_loop()
                loop.call_later(_CHALLENGE_WAIT_S, self._dial_if_waiting, rank)
        try:
            return await asyncio.wait_for(asyncio.shield(peer.ready), self.connect_timeout)
        except TimeoutError:
            raise PeerUnavailableError(
                peer.address.name, f"no connection within {self.connect_timeout:g} s"
            ) from None

    def _challenged(self, rank: int) -> bool:
        """Whether a connection from ``rank`` awaits its Auth (bounded: handshakes)."""
        return any(
            hs.state is State.CHALLENGED and hs.peer_rank == rank
            for hs, _ in self._handshakes.values()
        )

    def _start_dial(self, peer: Peer, rank: int) -> None:
        # Dialling from now on, not from when the task first runs: a Hello that arrives
        # in between must meet the tie-break, or both connections survive.
        peer.dialing = True
        asyncio.get_running_loop().create_task(self._dial(peer, rank))

    async def _dial(self, peer: Peer, rank: int) -> None:
        """Dial ``rank``, retrying (see ``DIAL_RETRY_DELAYS``) within ``connect_timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        name = peer.address.name
        refused = others = 0
        try:
            while peer.lost is None:  # bounded: each pass counts one try; the counts are capped
                error: BaseException | None = None
                try:
                    if await self._dial_once(peer, rank, deadline):
                        return
                    others += 1  # it still holds an old connection
                except (TimeoutError, ssl.SSLError, RemoteProtocolError) as exc:
                    self._dial_failed(peer, PeerUnavailableError(name, str(exc) or repr(exc)))
                    return
                except ConnectionRefusedError as exc:  # a dead process, or not yet listening
                    refused, error = refused + 1, exc
                except OSError as exc:  # a reset in the handshake: proves nothing
                    others, error = others + 1, exc
                if peer.conn is not None and not peer.conn.closed:
                    return  # adopted meanwhile, dialled by the peer
                if refused > len(REFUSED_RETRY_DELAYS):
                    self.declare_lost(
                        rank, PeerLostError(name, _refused(peer, refused, error), "redial_refused")
                    )
                    return
                if isinstance(error, ConnectionRefusedError):
                    delay: float | None = REFUSED_RETRY_DELAYS[refused - 1]
                else:
                    delay = (
                        DIAL_RETRY_DELAYS[others - 1] if others <= len(DIAL_RETRY_DELAYS) else None
                    )
                if delay is None or loop.time() + delay > deadline:
                    reason = f"{refused + others} tries: {error or 'already connected'}"
                    self._dial_failed(peer, PeerUnavailableError(name, reason))
                    return
                await asyncio.sleep(delay)
        finally:
            peer.dialing = False

    async def _dial_once(self, peer: Peer, rank: int, deadline: float) -> bool:
        """One dial and handshake; True when done (adopted, or failed for good: the
        waiters know), False to try again (the peer still holds an old connection).

        Raises:
            OSError: the socket failed (``TimeoutError``: no answer by ``deadline``).
            RemoteProtocolError: the peer answered wrongly.
        """
        loop = asyncio.get_running_loop()
        factory = functools.partial(self._make_connection, True)
        opened = self._dial_transport(peer.address, factory)
        conn = await asyncio.wait_for(opened, max(deadline - loop.time(), 0))
        waiter: asyncio.Future[Close] = loop.create_future()
        machine = Handshake.dialer(
            (self.name, self.rank), (peer.address.name, rank), self._key, self._max_frame_size,
            self,
        )  # fmt: skip
        self._handshakes[conn] = (machine, waiter)
        self._act(conn, machine.start())
        try:
            outcome = await asyncio.wait_for(waiter, max(deadline - loop.time(), 0))
        except BaseException:
            self._handshakes.pop(conn, None)
            conn.close()
            raise
        if outcome.refusal is Refusal.NONE:
            return True  # adopted already, or another connection won
        if outcome.refusal is Refusal.TIE_BREAK:
            # It keeps the connection it dials to us, adopted when its Auth comes. If that
            # does not happen within _TIE_BREAK_WAIT_S (its dial failed), ours tries again.
            ready = peer.ready
            if ready is None:
                return False
            try:
                await asyncio.wait_for(asyncio.shield(ready), _TIE_BREAK_WAIT_S)
            except (TimeoutError, ConnectionError):
                return False
            return True
        if outcome.refusal is Refusal.ALREADY_CONNECTED:
            return False  # it has not seen our old connection close yet
        if peer.conn is None:
            self._dial_failed(peer, PeerUnavailableError(peer.address.name, outcome.reason))
        return True

    async def _open(self, address: PeerAddress, factory: Callable[[], Connection]) -> Connection:
        """The Unix socket of a peer on this host if it answers, else TCP (TLS if set)."""
        if address.unix_path and self._host_id and address.host_id == self._host_id:
            try:
                return await open_unix_connection(address.unix_path, factory)
            except OSError as exc:  # same kernel, other container or network namespace
                _log.debug("Unix socket of %s: %s; using TCP", address.name, exc)
        return await open_connection(address.host, address.port, factory, self._ssl)

    def declare_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good (evidence: see the module's docstring); idempotent."""
        peer = self.peers[rank]
        if peer.lost is not None:
            return
        peer.lost = error
        self._drop_tentative(peer)
        self._dial_failed(peer, error)
        if self._on_declared_lost is not None:
            self._on_declared_lost(rank)

    def _dial_failed(self, peer: Peer, exc: BaseException) -> None:
        _log.debug("dial to %s failed: %s", peer.address.name, exc)
        if peer.ready is not None and not peer.ready.done():
            # Its waiters raise it; a lost peer's error is kept for good: a copy, so their
            # frames do not end up in the kept one's traceback.
            peer.ready.set_exception(own_copy(exc))
            peer.ready.exception()  # mark retrieved: waiters may all have given up
        peer.ready = None  # a later call may try again

    def adopt(self, peer: Peer, rank: int, conn: Connection, peer_max_frame: int) -> None:
        """Make ``conn`` (authenticated) ``rank``'s connection, or hold it back (below)."""
        conn.open(self._max_frame_size)  # authenticated: the handshake's limits are lifted
        conn.peer_max_frame = peer_max_frame  # what we send is checked against it
        conn.peer = rank
        conn.peer_name = peer.address.name
        if conn.initiated and self.rank > rank and self._challenged(rank):
            # Both dialled, and the lower rank's dial (challenged here) may still win: the
            # peer keeps the first connection it authenticates, and if that is its own, it
            # closes this one unread. Writing calls here now could lose them ("Broken pipe"
            # in a loaded 64-worker all-to-all, when each side kept a different one). So
            # this side writes nothing on it but a Ping: the peer's Pong proves the peer
            # adopted it (``on_pong`` installs it), the peer's Auth on its own dial
            # replaces it (the rule: the lower rank's dial wins), and its close drops it.
            # Frames for the peer wait meanwhile (a round trip, if it reads). The peer's own
            # frames on it are read as usual. A stranger's claim to the lower rank's name
            # changes nothing: the real peer's Pong still comes.
            peer.tentative = conn
            if peer.ready is None or peer.ready.done():
                peer.ready = asyncio.get_running_loop().create_future()
            send_message(conn, Ping())
            return
        self._install(peer, rank, conn)

    def _drop_tentative(self, peer: Peer) -> None:
        # Nothing but a Ping of ours was written on it: it is closed as if never adopted
        # (no loss to report, no redial, no calls to fail).
        held, peer.tentative = peer.tentative, None
        if held is not None:
            held.peer = None
            held.close()

    def on_pong(self, conn: Connection) -> None:
        """A Pong came on ``conn``: if it is held back (see ``adopt``), the peer adopted
        it; it becomes the peer's connection."""
        rank = conn.peer
        peer = self.peers.get(rank) if rank is not None else None
        if peer is not None and peer.tentative is conn and rank is not None:
            self._install(peer, rank, conn)

    def _install(self, peer: Peer, rank: int, conn: Connection) -> None:
        if peer.tentative is not conn:
            # The peer's Auth on its own dial (the lower rank's, which wins): it adopted
            # that one first, so it closes ours unread (see ``adopt``).
            self._drop_tentative(peer)
        peer.tentative = None
        peer.conn = conn
        peer.vanished = None
        if peer.ready is None or peer.ready.done():
            peer.ready = asyncio.get_running_loop().create_future()
        peer.ready.set_result(conn)
        _log.debug("%s connected to %s", self.name, peer.address.name)
        if self._on_adopted is not None:
            self._on_adopted(rank, conn)

    def take_back(self, rank: int, conn: Connection) -> bool:
        """Make ``conn`` (authenticated, detached while its peer was asked to close it
        for idleness: ``idle.py``) ``rank``'s connection again; False if another one is.
        Callers waiting for a connection get it (a dial they started meanwhile was
        refused as "already connected", and stops at its next look)."""
        peer = self.peers[rank]
        if peer.conn is not None and peer.conn is not conn and not peer.conn.closed:
            return False
        peer.conn = conn
        if peer.ready is None or peer.ready.done():
            peer.ready = asyncio.get_running_loop().create_future()
        peer.ready.set_result(conn)
        return True

    # -- the handshake: read, feed the machine, act -------------------------------------

    def on_handshake(self, conn: Connection, message: object) -> None:
        """A message received on ``conn`` before it was adopted: feed its handshake.

        An accepted connection's machine starts with its first message.
        """
        entry = self._handshakes.get(conn)
        if entry is None:
            if conn.initiated:  # its dial gave up on it (the reply came too late)
                conn.abort(RemoteProtocolError(f"unexpected {type(message).__name__}"))
                return
            machine = Handshake.acceptor(
                (self.name, self.rank), self._key, self._max_frame_size, self
            )
            entry = self._handshakes[conn] = (machine, None)
        machine, waiter = entry
        challenged = machine.state is State.CHALLENGED
        try:
            actions = machine.receive(message)
        except RemoteProtocolError as exc:
            self._handshakes.pop(conn, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
            if isinstance(exc, AuthenticationError):
                self._on_auth_failure(conn, exc)
            else:
                conn.abort(exc)
            if challenged:
                self._challenge_failed(machine.peer_rank)
            return
        self._act(conn, actions)

    def _act(self, conn: Connection, actions: list[Action]) -> None:
        """Perform the machine's actions, in order."""
        for action in actions:
            if isinstance(action, Send):
                send_message(conn, action.message)
                continue
            machine, waiter = self._handshakes.pop(conn, (None, None))
            if isinstance(action, Adopt):
                self.adopt(self.peers[action.rank], action.rank, conn, action.max_frame_size)
                outcome = Close(Refusal.NONE)
            else:
                outcome = action
                conn.close()
                if waiter is None and machine is not None and action.refusal is not Refusal.NONE:
                    name = machine.peer[0] if machine.peer is not None else "?"
                    _log.warning("refused a connection claiming to be %r: %s", name, action.reason)
            if waiter is not None and not waiter.done():
                waiter.set_result(outcome)

    # -- the roster the handshake consults (asyncrpc.protocol.handshake.Roster) -----------

    def refusal(self, name: str, rank: int) -> Refusal | None:
        """Why a dialer claiming ``(name, rank)`` may not connect now; None if it may."""
        peer = self.peers.get(rank)
        if peer is None or peer.address.name != name:
            return Refusal.UNKNOWN_WORKER
        if peer.lost is not None:
            return Refusal.LOST
        if peer.conn is not None and not peer.conn.closed:
            return Refusal.ALREADY_CONNECTED
        if peer.dialing and self.rank < rank:
            return Refusal.TIE_BREAK
        return None

    def connected(self, rank: int) -> bool:
        """Whether ``rank`` has a live, authenticated connection."""
        peer = self.peers.get(rank)
        return peer is not None and peer.conn is not None and not peer.conn.closed

    def on_lost(self, conn: Connection, exc: BaseException | None) -> int | None:
        """Forget ``conn``; return its peer's rank when it was authenticated.

        The peer stays reachable (the next call dials again) unless it said Goodbye.
        """
        machine, waiter = self._handshakes.pop(conn, (None, None))
        if waiter is not None and not waiter.done():
            error = exc if isinstance(exc, OSError) else None
            waiter.set_exception(error or ConnectionResetError("connection closed in handshake"))
        if machine is not None and machine.state is State.CHALLENGED:
            self._challenge_failed(machine.peer_rank)
        rank = conn.peer
        if rank is None:
            return None
        peer = self.peers[rank]
        if peer.tentative is conn and not conn.goodbye:
            # Closed before the peer's Pong: it kept its own dial (or the link broke);
            # nothing of ours was written on it. Callers wait for the peer's Auth, or dial.
            peer.tentative = None
            self._challenge_failed(rank)
            return None
        if peer.conn is conn:
            peer.conn = None
        if conn.goodbye:
            self.declare_lost(rank, PeerLostError(peer.address.name, GOODBYE_REASON, "goodbye"))
        elif closed_by_peer(exc) and peer.conn is None:
            peer.vanished = str(exc or "EOF")
        return rank

    def _challenge_failed(self, rank: int | None) -> None:
        # Callers waiting for this handshake instead of dialling (see ``connection``) dial.
        if rank is not None and not self._challenged(rank):
            self._dial_if_waiting(rank)

    def _dial_if_waiting(self, rank: int) -> None:
        peer = self.peers.get(rank)
        if peer is None or peer.ready is None or peer.ready.done() or peer.dialing:
            return
        if peer.tentative is not None:
            return  # our own dial, adopted by the peer unless it closes (see ``adopt``)
        if peer.lost is None and (peer.conn is None or peer.conn.closed):
            self._start_dial(peer, rank)

    def is_lost(self, rank: int) -> bool:
        return self.peers[rank].lost is not None


def _refused(peer: Peer, times: int, error: BaseException | None) -> str:
    """Why a peer whose address refuses connections is lost: its process has ended, and if
    it closed its last connection without a Goodbye, it did not end through shutdown()."""
    if peer.vanished is None:
        return f"connection refused {times} times ({error})"
    return (
        f"it closed its connection without a Goodbye ({peer.vanished}) and its address now "
        f"refuses connections: its process has ended ({NO_GOODBYE_HINT})"
    )


# How long a dial that lost the tie-break waits for the peer's own dial to reach it.
_TIE_BREAK_WAIT_S = 2.0
# How long a caller waits for a peer's handshake in progress before dialling itself.
_CHALLENGE_WAIT_S = 0.25
