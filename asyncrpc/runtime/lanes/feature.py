"""Lanes as a feature of the agent: both ends, told of lost peers, closed, counted (layer
L2.46).

The calling threads' lanes (``client.py``) serve the outbox's synchronous calls; the lane
server (``server.py``), when this worker takes lanes, runs what peers' lanes carry. The
agent sees one feature: it hears the peers that are lost, closes both ends, closes its
callers' idle lanes (``idle_timeout``), and adds their figures to the worker's (calls,
replies and bytes on lanes count as the loop's do).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrpc.errors import PeerLostError
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.lanes.client import CallerLanes
from asyncrpc.runtime.lanes.server import LaneServer
from asyncrpc.runtime.lanes.serving import LaneReply, Serving, Writer

__all__ = ["Lanes"]


class Lanes(Feature):
    """This worker's lanes, both ends.

    Args:
        callers: the lanes of its calling threads.
        server: the lanes it serves (listening on nothing when it takes none, as with TLS
            or ``sync_lanes=0``).
        loop: the agent's loop (its timer closes idle lanes).
        idle_timeout: seconds after which a lane no call used is closed (0: never).
    """

    name = "lanes"

    def __init__(
        self, callers: CallerLanes, server: LaneServer,
        loop: asyncio.AbstractEventLoop | None = None, idle_timeout: float = 0.0,
    ) -> None:  # fmt: skip
        self.callers = callers
        self._server = server
        self._loop, self._idle_timeout = loop, idle_timeout
        self._timer: asyncio.TimerHandle | None = None
        self.idle_closed = 0

    def serve(self, serving: Serving) -> None:
        """The group is joined and the dispatcher built: served lanes may carry calls."""
        self._server.serve(serving)
        if self._loop is not None and self._idle_timeout > 0:
            self._timer = self._loop.call_later(self._period(), self._tick)

    def _period(self) -> float:
        # As the connections' idle closer (net/idle.py): a lane is closed between one
        # and one and a half timeouts after its last call; never a spinning timer.
        return max(self._idle_timeout / 2, 0.05)

    def _tick(self) -> None:
        self._timer = None
        if self.callers.closed:
            return
        self.idle_closed += self.callers.close_idle(self._idle_timeout)
        assert self._loop is not None
        self._timer = self._loop.call_later(self._period(), self._tick)

    @staticmethod
    def reply_writer(write: Writer) -> Writer:
        """``write`` for the dispatcher's replies, but a request a lane handed to the loop
        is answered through the lane's thread (its connection is a ``LaneReply``)."""

        def write_reply(conn: Any, pieces: list[Any], keep: object, forks: Any) -> None:
            if type(conn) is LaneReply:
                conn.deliver(pieces, keep, forks)
            else:
                write(conn, pieces, keep, forks)

        return write_reply

    @property
    def in_flight(self) -> int:
        """Calls this worker's threads wait for on lanes."""
        return self.callers.in_flight

    @property
    def running(self) -> int:
        """Requests running on served lanes' threads."""
        return self._server.running

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        self.callers.on_peer_lost(rank, error)
        self._server.on_peer_lost(rank)

    def statistics(self) -> dict[str, int | float]:
        figures: dict[str, int | float] = dict(self.callers.stats())
        figures["lanes_idle_closed"] = self.idle_closed
        figures["running_requests"] = self.running  # beside the dispatcher's (summed)
        for key, value in self._server.stats().items():
            figures[key] = figures.get(key, 0) + value
        return figures

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.callers.close()
        self._server.close()
