"""The loopback connection: calls from a worker to itself (layer L2.2).

Frames are decoded and handled on a later loop iteration, exactly as if they had crossed a
socket, so a call to self has the same pickling semantics as any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from asyncrpc.protocol.wire import Allocator, Frame, FrameDecoder

__all__ = ["LoopbackConnection"]

_log = logging.getLogger(__name__)


class LoopbackConnection:
    """A connection whose other end is this worker."""

    def __init__(
        self,
        rank: int,
        name: str,
        loop: asyncio.AbstractEventLoop,
        allocate: Allocator,
        deliver: Callable[[Any, Frame], None],
    ) -> None:
        self._decoder = FrameDecoder(allocate=allocate)
        self._loop = loop
        self._deliver = deliver
        self.peer: int | None = rank
        self.peer_name: str | None = name
        self.closed = False
        self.goodbye = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0  # as a Connection's (the network counts call frames on both)
        self.idle: str | None = None  # never closed for idleness

    def send(self, pieces: list[Any], keepalive: object = None) -> None:
        # Pieces are decoded (copied) right here, so keepalive needs no holding.
        frames = []
        for piece in pieces:
            frames.extend(self._decoder.feed(piece))
        for frame in frames:
            self._loop.call_soon(self._deliver, self, frame)

    def close(self) -> None:
        self.closed = True

    def abort(self, reason: BaseException) -> None:
        _log.error("loopback protocol error (a bug): %s", reason)
