"""Frames to each peer, in order, across the connections that come and go (layer L2.2).

A frame for a peer goes straight onto its connection, or waits (in order, behind the
frames already waiting) until one is made, or until what it must wait for is over (the
call pipeline's ``ready`` stage: GPU work still filling its bytes). Refcount frames, and
the RRef forks that other frames carry, are followed in a per-peer log (``reflog.py``)
until the peer has surely read them: a new connection replays the frames, and forks
written on a connection that died first are asked about. A frame whose wait is a
``FrameInParts`` (a large CUDA tensor still being copied to the host, chunk by chunk) is
written part by part as its bytes appear, with nothing else on the connection in between.
The network owns one ``Links``, built from the named parts it uses, and feeds it
connection events; what happens to forks in frames that never left, or that died with a
connection, goes up to the network's receiver (``ForkEvents``): the RRef layer sits above.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any, Protocol, runtime_checkable

from asyncrpc.errors import ClosedError, FrameTooLargeError, PeerLostError, UnknownWorkerError
from asyncrpc.errorstate import own_copy
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.reflog import ForkPair, RefLog
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import Ping
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.net.heartbeat import Watched
from asyncrpc.runtime.net.loopback import LoopbackConnection
from asyncrpc.runtime.net.peers import PeerTable
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.ports import OutgoingFrame, SentCall
from asyncrpc.runtime.shm.shm import SharedMemory

__all__ = ["ForkEvents", "FrameInParts", "Links", "write_in_parts"]

_log = logging.getLogger(__name__)


@runtime_checkable
class FrameInParts(Protocol):
    """What a ``ready`` stage may return instead of a plain wait, for a large frame whose
    bytes are still being produced in order (a CUDA tensor copied to the host chunk by
    chunk): the frame cut into parts, each yielded once its bytes exist, so that writing
    the first parts overlaps producing the next. Awaiting it waits for all the bytes (for
    a writer that takes frames whole)."""

    def parts(self, pieces: list[Any]) -> AsyncIterator[list[Any]]: ...

    def __await__(self) -> Generator[Any, None, None]: ...


async def write_in_parts(
    conn: Connection, pieces: list[Any], ready: FrameInParts, keep: object = None
) -> None:
    """Write one frame on ``conn`` part by part as ``ready`` yields them; nothing else is
    written on ``conn`` in between (frames sent meanwhile follow the last part).

    Raises:
        FrameTooLargeError: over the peer's limit; nothing was written.
        ClosedError: the connection closed; if a part was written, the connection is
            aborted (the peer must not read a frame cut short).
    """
    conn.check_size(pieces)
    if conn.in_parts:  # another frame is going out in parts: this one follows it, whole
        await ready
        conn.send(pieces, keep)
        return
    conn.begin_parts()
    complete = False
    parts = ready.parts(pieces)
    try:
        async for part in parts:
            conn.send_part(part, keep)
        complete = True
    finally:
        conn.end_parts(complete)
        close = getattr(parts, "aclose", None)  # an async generator's: its finally runs now
        if close is not None:
            await close()


class ForkEvents(Protocol):
    """What the links report of the RRef forks frames carry (to the network's receiver:
    the RRef layer sits above the network)."""

    def on_forks_unsent(self, rank: int, forks: list[ForkPair]) -> None:
        """A frame carrying these forks to ``rank`` was never written: nobody holds them."""

    def on_forks_in_doubt(self, rank: int, forks: list[ForkPair]) -> None:
        """Frames carrying these forks went out on a connection that died before ``rank``
        acknowledged them: ask it whether they arrived."""

    def on_unknown_peer(self, rank: int) -> None:
        """Nobody can find ``rank`` (a dynamic group whose store has gone): what waits for
        it (a fork's confirmation by its owner) waits for nothing."""


class Links:
    """The frames bound for every peer of one worker, on its loop thread.

    Args:
        rank: this worker's rank (its frames go to the loopback).
        loop: the agent's loop.
        counters: the worker's counters (failed calls, reconnects).
        peers: the peer table (connections, dialling).
        loopback: the connection to this worker itself.
        shm: same-host memory (chunks lent to frames that never leave go back).
        addresses: names of the members, for logs.
        events: told what happens to forks in frames (see ``ForkEvents``).
        peer_known: whether a rank is a peer yet (a dynamic group's member met later).
        know_peer: looks a rank up (a dynamic group's store), raising
            ``UnknownWorkerError`` if no member has it.
    """

    def __init__(
        self, rank: int, loop: asyncio.AbstractEventLoop, counters: Counters,
        peers: PeerTable, loopback: LoopbackConnection, shm: SharedMemory,
        addresses: dict[int, PeerAddress], events: ForkEvents,
        peer_known: Callable[[int], bool], know_peer: Callable[[int], Awaitable[None]],
    ) -> None:  # fmt: skip
        self._rank, self._loop, self._counters = rank, loop, counters
        self._peers, self._loopback, self._shm = peers, loopback, shm
        self._addresses, self._events = addresses, events
        self._peer_known, self._know_peer = peer_known, know_peer
        # Frames waiting for a connection to be made, or behind a frame not ready yet, by
        # peer, in the order they were sent (one task drains each queue).
        self._unsent: dict[int, deque[OutgoingFrame]] = {}
        # Refcount frames and forks by peer, until the peer has surely read them.
        self._logs: dict[int, RefLog] = {}
        self._linked: set[int] = set()  # peers connected at least once

    # -- sending ---------------------------------------------------------------------------

    def send(self, frame: OutgoingFrame) -> None:
        """Write ``frame`` to its peer, connecting first if needed; failures fail its call.

        Frames to one peer leave in the order they were sent, also while the connection is
        being made or while a frame before them waits to be ``ready``: a frame sent then
        waits behind the ones already waiting. Its ``forks`` are followed until the peer
        reads it. Its ``ready`` is awaited on the loop before it is written; if that
        raises, the frame is dropped and its call fails with that error.
        """
        rank = frame.rank
        waiting = self._unsent.get(rank)
        if waiting is not None:
            waiting.append(frame)
            return
        if frame.ready is None:
            if rank == self._rank:
                self._loopback.send(frame.pieces)
                return
            peer = self._peers.peers.get(rank)
            if peer is not None and peer.conn is not None and not peer.conn.closed:
                self._send_checked(peer.conn, frame)
                return
        self._unsent[rank] = deque([frame])
        self._loop.create_task(self._drain(rank))

    def send_ref(self, rank: int, pieces: list[Any]) -> None:
        """Send a refcount frame; it is sent again on a new connection until acknowledged."""
        # A dynamic group's member not looked up yet has no log for this first frame: it
        # goes out once the look-up is done (a connection lost before its Pong loses it).
        if rank != self._rank and self._peer_known(rank):
            log = self._logs.setdefault(rank, RefLog())
            if log.add(pieces):
                peer = self._peers.peers[rank]
                if peer.conn is not None and not peer.conn.closed:
                    self.ping(peer.conn)
        self.send(OutgoingFrame(rank, pieces))

    def write(
        self, conn: Connection, pieces: list[Any], keep: object = None,
        forks: list[ForkPair] | None = None,
    ) -> None:  # fmt: skip
        """Write a frame on ``conn``; a closed connection drops it (the peer is gone)."""
        try:
            conn.send(pieces, keep)
        except ClosedError:
            _log.debug("dropped a frame for %s: connection closed", conn.peer_name)
            if conn.peer is not None:
                self.undelivered(conn.peer, forks)
            return
        if forks and conn.peer is not None:
            self._wrote_forks(conn.peer, forks)

    def waiting(self, rank: int) -> bool:
        """Whether frames for ``rank`` still wait here (for a connection, or behind one)."""
        return rank in self._unsent

    def holds(self, rank: int, call_id: int) -> bool:
        """Whether the request of ``call_id`` still waits here (it will not be written if
        its call is over by then)."""
        waiting = self._unsent.get(rank)
        return waiting is not None and any(
            f.call is not None and f.call.call_id == call_id for f in waiting
        )

    async def _drain(self, rank: int) -> None:
        """Write the frames waiting for ``rank`` in order, each once it is ready and a
        connection is up; frames sent meanwhile join the queue. Ends once it is empty."""
        waiting = self._unsent[rank]
        try:
            while waiting:  # bounded: each turn writes or drops the first frame
                frame = waiting[0]
                ready = frame.ready
                if isinstance(ready, FrameInParts) and await self._sent_in_parts(rank, waiting):
                    continue
                if ready is not None:
                    try:
                        await ready
                    except Exception as exc:  # the frame cannot go: its call fails
                        waiting.popleft()
                        self._shm.unlend(frame.keep)
                        self._fail_unsent(rank, frame.call, exc)
                        self.undelivered(rank, frame.forks)
                        continue
                    frame = waiting[0] = frame._replace(ready=None)
                if frame.call is not None and not frame.call.wanted():
                    waiting.popleft()
                    self._shm.unlend(frame.keep)
                    self.undelivered(rank, frame.forks)
                    continue  # timed out or cancelled while waiting: the callee never runs it
                conn = await self._connection(rank)
                waiting.popleft()
                if conn is None:
                    self._loopback.send(frame.pieces)
                else:
                    self._send_checked(conn, frame)
        except (ConnectionError, OSError, UnknownWorkerError) as exc:
            for frame in waiting:
                _discard(frame.ready)
                self._fail_unsent(rank, frame.call, exc)
                self.undelivered(rank, frame.forks)
            waiting.clear()
            if isinstance(exc, UnknownWorkerError):
                # An RRef named an owner nobody can find (a dynamic group whose store has
                # gone): its forks wait for no confirmation, as if the owner were lost.
                self._events.on_unknown_peer(rank)
        finally:
            for frame in waiting:  # only left by a cancelled drain (shutdown)
                _discard(frame.ready)
            del self._unsent[rank]  # from now on frames go straight to the connection

    async def _connection(self, rank: int) -> Connection | None:
        """An open connection to ``rank`` (None: this worker, through its loopback)."""
        if rank == self._rank:
            return None
        peer = self._peers.peers.get(rank)
        if peer is not None and peer.conn is not None and not peer.conn.closed:
            return peer.conn
        await self._know_peer(rank)
        return await self._peers.connection(rank)

    def _send_checked(self, conn: Connection, frame: OutgoingFrame) -> None:
        try:
            conn.send(frame.pieces, frame.keep)
        except FrameTooLargeError as exc:  # nothing was written: the call fails alone
            self._fail_unsent(frame.rank, frame.call, exc)
            self.undelivered(frame.rank, frame.forks)
            return
        self._written(conn, frame)

    def _written(self, conn: Connection, frame: OutgoingFrame) -> None:
        """A frame went out on ``conn``: follow its forks; losing ``conn`` fails its call."""
        if frame.forks:
            self._wrote_forks(frame.rank, frame.forks)
        if frame.call is not None:
            frame.call.written(conn)

    async def _sent_in_parts(self, rank: int, waiting: deque[OutgoingFrame]) -> bool:
        """Write (or drop) the first waiting frame, whose ready stage gives it in parts;
        False to leave it to the whole-frame path (a frame to this worker itself)."""
        frame = waiting[0]
        ready = frame.ready
        assert isinstance(ready, FrameInParts)
        if rank == self._rank:
            return False
        if frame.call is not None and not frame.call.wanted():
            waiting.popleft()
            self._shm.unlend(frame.keep)
            self.undelivered(rank, frame.forks)
            return True  # the callee never runs it; its parts are never made
        conn = await self._connection(rank)
        if conn is None:
            return False
        waiting.popleft()
        await self._write_parts(conn, frame, ready)
        return True

    async def _write_parts(
        self, conn: Connection, frame: OutgoingFrame, ready: FrameInParts
    ) -> None:
        try:
            await write_in_parts(conn, frame.pieces, ready, frame.keep)
        except (FrameTooLargeError, ClosedError) as exc:  # this call fails; the rest go on
            self._fail_unsent(frame.rank, frame.call, exc)
            self.undelivered(frame.rank, frame.forks)
            return
        self._written(conn, frame)

    def _fail_unsent(self, rank: int, call: SentCall | None, exc: BaseException) -> None:
        # One error fails every frame waiting for the peer: each call raises its own copy.
        if call is not None and call.unsent(own_copy(exc)):
            self._counters.calls_failed += 1
        else:
            address = self._addresses.get(rank)  # None: a rank nobody could look up
            # A peer declared lost was logged then, with why: this frame adds nothing.
            log = _log.debug if isinstance(exc, PeerLostError) else _log.warning
            log("could not send to %s: %s", address.name if address else rank, exc)

    # -- forks inside frames ---------------------------------------------------------------

    def _wrote_forks(self, rank: int, forks: list[ForkPair]) -> None:
        # Followed until a Pong proves the peer read them; in doubt if the link dies first.
        if rank in self._peers.peers:
            self._logs.setdefault(rank, RefLog()).wrote(forks)

    def undelivered(self, rank: int, forks: list[ForkPair] | None) -> None:
        """The frame carrying these forks was never written: nobody will hold them."""
        if forks:
            self._events.on_forks_unsent(rank, forks)

    # -- acknowledgements ------------------------------------------------------------------

    def ping(self, conn: Watched) -> None:
        conn.send(encode_frame(Ping().to_fields(), b""))
        rank = conn.peer
        log = self._logs.get(rank) if rank is not None else None
        peer = self._peers.peers.get(rank) if rank is not None else None
        if log is not None and peer is not None and peer.conn is conn:
            # Its Pong acknowledges the refcount frames sent before it. Only pings on the
            # peer's connection mark the log: our own dial held back in a race (peers.py,
            # ``adopt``) may be dropped without a loss report, and a mark of its would
            # stay at the head of the log for good.
            log.pinged(conn)

    def ponged(self, conn: Connection, rank: int) -> None:
        log = self._logs.get(rank)
        if log is not None:
            log.ponged(conn)

    def ask_acks(self) -> None:
        """Ping busy links too (the heartbeat pings idle ones) while refcount frames wait
        for an acknowledgement, so that the logs empty (see reflog.py)."""
        peers = self._peers.peers
        for rank, log in list(self._logs.items()):
            conn = peers[rank].conn
            if conn is not None and not conn.closed and log.awaiting_ack():
                self.ping(conn)

    def unacked_frames(self) -> int:
        return sum(len(log) for log in list(self._logs.values()))

    def unacked(self, rank: int) -> int:
        """Refcount frames to ``rank`` not acknowledged yet (forks in frames included)."""
        log = self._logs.get(rank)
        return 0 if log is None else len(log)

    # -- connection events -----------------------------------------------------------------

    def on_adopted(self, rank: int, conn: Connection) -> None:
        """A new connection to ``rank``: refcount frames it may have missed go first."""
        if rank in self._linked:
            self._counters.reconnects += 1
            self._shm.on_peer_lost(rank)  # whatever the old link had lent, it ends here
        self._linked.add(rank)
        log = self._logs.get(rank)
        if log is None or not len(log):
            return
        try:
            for pieces in log.replay():
                conn.send(pieces)
        except ClosedError:
            pass  # the next connection replays them

    def on_lost(self, rank: int, conn: Connection, ask: bool) -> None:
        """``conn`` to ``rank`` closed: ask (if ``ask``) about the forks it may have lost."""
        log = self._logs.get(rank)
        if log is None:
            return
        in_doubt = log.lost(conn)
        if in_doubt and ask:
            self._events.on_forks_in_doubt(rank, in_doubt)

    def forget(self, rank: int) -> None:
        """``rank`` is gone for good: nothing will be resent to it."""
        self._logs.pop(rank, None)


def _discard(ready: Awaitable[None] | None) -> None:
    """Close a wait that will never be awaited (no "never awaited" warning)."""
    close = getattr(ready, "close", None)  # a coroutine's
    if close is not None:
        close()
