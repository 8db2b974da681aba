"""What a lane's serving thread needs of its worker, and the connection a request it hands
to the loop replies on (layer L2.46).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire.messages import Request
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.pipeline import Pipeline
from asyncrpc.runtime.lanes.handshake import LaneRoster

__all__ = ["LaneForks", "LaneReply", "Serving", "Writer"]

# Writes a reply frame on the connection its request came on: (conn, pieces, keep, forks).
Writer = Callable[[Any, list[Any], object, Any], None]


class LaneForks(Protocol):
    """What the lanes' threads ask of the RRef layer: the forks their replies carry, and
    the values of the remote() requests they serve."""

    def on_remote_request(self, peer: int, request: Request) -> None:
        """A remote() request arrived: register the caller's fork before it runs."""

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        """Its function finished: its value (or exception) is the owner's."""

    def undelivered(self, rank: int, forks: list[Any]) -> None:
        """A reply carrying these forks to ``rank`` was never written."""

    def query_forks(self, rank: int, forks: list[Any]) -> None:
        """Replies carrying these forks went out on a lane that died before ``rank``
        acknowledged them: ask it whether they arrived."""


@dataclass(frozen=True, slots=True)
class Serving:
    """What a lane's thread needs of its worker, once the group is joined."""

    name: str
    rank: int
    key: bytes
    max_frame_size: int
    handshake_timeout: float
    roster: LaneRoster
    serializer: Serializer  # no shared memory: a lane's reply travels on the lane
    pipeline: Pipeline
    dispatcher: Dispatcher
    forks: LaneForks
    run_on_loop: Callable[..., None]
    print_errors: bool
    busy_poll: float = 0.0  # seconds a lane's thread polls for the next request (option)
    coded: Mapping[str, CodedCall] = field(default_factory=dict)  # the features' coded calls


class LaneReply:
    """The connection the dispatcher replies on for a request a lane handed to the loop:
    the reply frame goes back to the lane's thread, which writes it."""

    __slots__ = ("_done", "_frame", "closed", "peer", "peer_name")
    acks_forks = True  # the dispatcher asks the caller to Ack the RRef forks of a reply

    def __init__(self, peer: int, peer_name: str) -> None:
        self.peer: int | None = peer
        self.peer_name: str | None = peer_name
        self.closed = False
        self._frame: tuple[list[Any], object, Any] | None = None
        self._done = threading.Lock()
        self._done.acquire()

    def deliver(self, pieces: list[Any], keep: object, forks: Any) -> None:
        """The dispatcher's reply (on the loop thread)."""
        if self._frame is None and not self.closed:
            self._frame = (pieces, keep, forks)
            self._done.release()

    def abandon(self) -> None:
        """Nobody will reply (the lane is closing): wake the lane's thread."""
        if not self.closed:
            self.closed = True
            if self._frame is None:
                self._done.release()

    def wait(self) -> tuple[list[Any], object, Any] | None:
        self._done.acquire()
        return self._frame
