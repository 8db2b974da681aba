"""Closing connections both sides have left idle (layer L2.2).

With ``idle_timeout`` set, one loop timer looks at each authenticated connection every
half timeout. A connection that carried no call frame in for ``idle_timeout``, to a peer
this worker has nothing in flight with (no call waiting for it, no request of its
running here, no refcount frame unacknowledged), is offered for closing: this side
detaches it (later frames for the peer wait for a new connection) and writes ``Idle(ask)``
as its last frame on it. The peer closes it if it has nothing in flight with this worker
either, or answers ``Idle(ask=False)`` and this side takes it back.

Why both sides must agree: a frame written on a connection the other side closes is
lost with it. The asker writes nothing after its ask, so the peer, closing once it has
read the ask, loses nothing of the asker's; the peer closes only when it has no call
waiting on this worker and no request of its running here, and then writes nothing
more on it. Requests the peer wrote before it read the ask make it refuse (it has a call
waiting), and the asker still answers them on the connection they came on. Two asks that
cross both close. A closed idle connection is not redialled at once (a lost one is); the
next frame for the peer dials.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import Idle
from asyncrpc.runtime.net.peers import PeerTable
from asyncrpc.runtime.net.transport import Connection

__all__ = ["IdleCloser"]

_log = logging.getLogger(__name__)
# The timer's period is half the timeout, but never under this: a tiny timeout (tests)
# must not spin the loop.
_MIN_TICK_S = 0.05


class IdleCloser:
    """Offers idle connections for closing and answers the peers' offers.

    Args:
        loop: the agent's loop.
        timeout: ``idle_timeout`` in seconds (0: off; ``start`` does nothing).
        connections: this worker's connections.
        peers: the peer table (connections are detached from and given back to it).
        busy_peers: the ranks this worker has something in flight with now.
        unacked: how many refcount frames to a rank wait for its acknowledgement.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout: float,
        connections: Callable[[], Iterable[Connection]], peers: PeerTable,
        busy_peers: Callable[[], set[int]], unacked: Callable[[int], int],
    ) -> None:  # fmt: skip
        self._loop, self._timeout = loop, timeout
        self._connections, self._peers = connections, peers
        self._busy_peers, self._unacked = busy_peers, unacked
        # Per connection: the call-frame count last seen, and when it last changed.
        self._seen: dict[Connection, tuple[int, float]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self._timeout > 0 and self._timer is None:
            self._timer = self._loop.call_later(self._period(), self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._seen.clear()

    def _period(self) -> float:
        return max(self._timeout / 2, _MIN_TICK_S)

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self._period(), self._tick)
        now = self._loop.time()
        seen: dict[Connection, tuple[int, float]] = {}
        idle: list[Connection] = []
        for conn in list(self._connections()):
            if conn.peer is None or conn.closed or conn.idle is not None:
                continue
            count, since = self._seen.get(conn, (-1, now))
            if conn.frames_in != count:
                count, since = conn.frames_in, now
            seen[conn] = (count, since)
            if now - since >= self._timeout:
                idle.append(conn)
        self._seen = seen  # forgets connections that closed
        if idle:
            busy = self._busy_peers()
            for conn in idle:
                if self._free(conn, busy):
                    self._ask(conn)

    def _free(self, conn: Connection, busy: set[int]) -> bool:
        """Whether this worker has nothing in flight with ``conn``'s peer, which still
        uses ``conn`` as its connection."""
        rank = conn.peer
        assert rank is not None
        peer = self._peers.peers.get(rank)
        return (
            peer is not None and peer.conn is conn and rank not in busy
            and not self._unacked(rank)
        )  # fmt: skip

    def _ask(self, conn: Connection) -> None:
        conn.idle = "asked"
        self._detach(conn)
        _send(conn, ask=True)

    def _detach(self, conn: Connection) -> None:
        assert conn.peer is not None
        peer = self._peers.peers[conn.peer]
        if peer.conn is conn:
            peer.conn = None

    def on_idle(self, conn: Connection, ask: bool) -> None:
        """The peer's ``Idle`` on ``conn``: an offer to close it, or a refusal of ours."""
        if conn.closed or conn.peer is None:
            return
        if not ask:
            if conn.idle == "asked":
                conn.idle = None
                self._seen.pop(conn, None)  # idle for a whole timeout again before asking
                if not self._peers.take_back(conn.peer, conn):
                    conn.close()  # another connection was adopted meanwhile
            return
        crossing = conn.idle == "asked"  # both asked: both wrote their last frame
        if crossing or self._free(conn, self._busy_peers()):
            conn.idle = "closing"
            self._detach(conn)
            _log.debug("closing the idle connection to %s", conn.peer_name)
            conn.close()
        else:
            _send(conn, ask=False)


def _send(conn: Connection, *, ask: bool) -> None:
    conn.send(encode_frame(Idle(ask).to_fields(), b""))
