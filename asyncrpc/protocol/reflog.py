"""RRef refcount messages kept until the peer has surely read them (layer L1).

A connection that drops may take refcount messages with it (a ForkAccepted, a UserDelete
still in the kernel's buffers). Losing one leaks an RRef or leaves a fork unconfirmed for
good. So each message sent to a peer stays in that peer's log until acknowledged, and a new
connection to the peer starts by sending the log again. The refcount state machine ignores
late and duplicate deliveries (``asyncrpc/protocol/refcount.py``), so resending what did
arrive is harmless.

The acknowledgement costs nothing new: a connection is FIFO both ways and a peer answers
every Ping with a Pong in order, so a Pong proves that everything sent before its Ping was
read. Every Ping sent (the heartbeat's, one sent once ``ack_every`` messages wait, or one
per heartbeat tick while frames wait) marks the log; its Pong trims the log up to that
mark. No asyncio here: the agent calls in.

The log also follows the RRef forks written to the peer inside other frames (calls,
replies, remote() requests). Those frames are not resent (a call runs at most once), so a
fork whose frame was written on a connection that died before a Pong covered it is *in
doubt*: ``lost`` hands it back, and the agent asks the peer about it (``ForkQuery``).
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["ForkPair", "RefLog"]

# A fork written to the peer: (rref_id, fork_id), as the wire carries them.
ForkPair = tuple[tuple[int, int], tuple[int, int]]


class RefLog:
    """The unacknowledged refcount frames to one peer, oldest first."""

    __slots__ = ("_ack_every", "_entries", "_marks", "_seq", "_written")

    def __init__(self, ack_every: int = 256) -> None:
        self._ack_every = ack_every
        self._seq = 0  # sequence number of the next frame logged
        self._entries: collections.deque[tuple[int, list[Any]]] = collections.deque()
        # Pings in flight on a connection: (the connection, the sequence number it covers).
        self._marks: collections.deque[tuple[object, int]] = collections.deque()
        # Forks written inside other frames, not yet covered by a Pong: (sequence, fork).
        self._written: collections.deque[tuple[int, ForkPair]] = collections.deque()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, pieces: list[Any]) -> bool:
        """Log a frame; return True when a Ping should go out to acknowledge the log."""
        self._entries.append((self._seq, pieces))
        self._seq += 1
        since = self._seq - (self._marks[-1][1] if self._marks else self._entries[0][0])
        return since >= self._ack_every

    def wrote(self, transfers: list[ForkPair]) -> None:
        """A frame carrying these forks was written on the current connection."""
        for transfer in transfers:
            self._written.append((self._seq, transfer))
            self._seq += 1

    @property
    def forks_in_flight(self) -> int:
        return len(self._written)

    def awaiting_ack(self) -> bool:
        """Whether frames or forks are logged that no Ping in flight covers."""
        if not self._entries and not self._written:
            return False
        return not self._marks or self._marks[-1][1] < self._seq

    def pinged(self, conn: object) -> None:
        """A Ping went out on ``conn``: its Pong acknowledges everything logged so far."""
        self._marks.append((conn, self._seq))

    def ponged(self, conn: object) -> None:
        """A Pong came on ``conn``: drop what its Ping covered (bounded by the log)."""
        if not self._marks or self._marks[0][0] is not conn:
            return  # a Pong of a connection this log no longer follows
        _, upto = self._marks.popleft()
        for log in (self._entries, self._written):
            while log and log[0][0] < upto:
                log.popleft()

    def lost(self, conn: object) -> list[ForkPair]:
        """``conn`` is gone: its Pings will never be answered.

        Returns:
            The forks written on it that no Pong covered: in doubt (all of them were
            written on ``conn``, the only connection to the peer since the last loss).
        """
        self._marks = collections.deque(m for m in self._marks if m[0] is not conn)
        in_doubt = [transfer for _, transfer in self._written]
        self._written.clear()
        return in_doubt

    def replay(self) -> list[list[Any]]:
        """Every frame not yet acknowledged, oldest first, to send on a new connection."""
        return [pieces for _, pieces in self._entries]
