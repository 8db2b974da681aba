"""Graceful shutdown barriers and the loopback connection for calls to self (layer L3).

Graceful shutdown runs in rounds separated by store barriers, each bounded by one
deadline: (1) every worker finishes its own outstanding calls; (2) every worker releases
its user RRefs and waits for the owners to hear of it; (3) owners drain their deletes and
report leaks; then connections close. A barrier fails fast, naming the peer, when a missing
worker's connection is known to be lost, so a dead peer never hangs shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrpc.errors import ShutdownError
from asyncrpc.protocol.wire import FrameDecoder

if TYPE_CHECKING:
    from asyncrpc.runtime.agent import Agent

__all__ = ["Lifecycle", "LoopbackConnection"]

_log = logging.getLogger("asyncrpc.runtime.shutdown")
_POLL_S = 0.005


class LoopbackConnection:
    """A connection from a worker to itself: frames are decoded and handled on a later
    loop iteration, exactly as if they had crossed a socket (same pickling semantics)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._decoder = FrameDecoder(allocate=agent.serializer.allocate)
        self.peer: int | None = agent.rank
        self.peer_name: str | None = agent.name
        self.closed = False
        self.goodbye = False
        self.bytes_in = 0
        self.bytes_out = 0

    def send(self, pieces: list[Any], keepalive: object = None) -> None:
        # Pieces are decoded (copied) right here, so keepalive needs no holding.
        frames = []
        for piece in pieces:
            frames.extend(self._decoder.feed(piece))
        for frame in frames:
            self._agent.loop.call_soon(self._agent.on_frame, self, frame)  # type: ignore[arg-type]

    def close(self) -> None:
        self.closed = True

    def abort(self, reason: BaseException) -> None:
        _log.error("loopback protocol error (a bug): %s", reason)


class Lifecycle:
    """The graceful-shutdown protocol of one agent."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._loopback: LoopbackConnection | None = None

    @property
    def loopback(self) -> LoopbackConnection:
        if self._loopback is None:
            self._loopback = LoopbackConnection(self._agent)
        return self._loopback

    async def graceful(self, deadline: float) -> None:
        """Run the shutdown rounds; raise ``ShutdownError`` if one cannot complete."""
        agent = self._agent
        await self._until(lambda: len(agent.pending) == 0, deadline, "finishing own calls")
        await self._barrier("calls-done", deadline)
        rrefs = agent.rrefs
        if rrefs is not None:
            rrefs.release_all_users()
            await self._until(rrefs.quiescent, deadline, "releasing user RRefs")
        await self._barrier("users-released", deadline)
        if rrefs is not None:
            # Deletes sent before the barrier may still be on the wire: give them a moment.
            await self._until(
                lambda: not rrefs.owner_leaks(), min(deadline, time.monotonic() + 1.0), None
            )
            rrefs.report_leaks()
        await self._until(lambda: len(agent.dispatcher) == 0, deadline, "finishing requests")
        await self._barrier("closing", deadline)
        await self._release_store(deadline)

    async def _until(
        self, condition: Callable[[], bool], deadline: float, what: str | None
    ) -> None:
        while not condition():
            if time.monotonic() > deadline:
                if what is None:
                    return
                raise ShutdownError(f"shutdown timed out while {what}")
            await asyncio.sleep(_POLL_S)

    async def _barrier(self, tag: str, deadline: float) -> None:
        agent = self._agent
        group = agent.group
        if group is None or agent.world_size <= 1:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, group.arrive, tag)
        delay = _POLL_S
        while True:
            missing = await loop.run_in_executor(None, group.missing, tag)
            if not missing:
                return
            lost = [r for r in missing if self._is_lost(r)]
            if lost:
                # A peer may have arrived since the read above and then closed its
                # connections: it is dead only if the store still misses it now.
                still = set(await loop.run_in_executor(None, group.missing, tag))
                dead = [repr(agent.addresses[r].name) for r in lost if r in still]
                if dead:
                    raise ShutdownError(f"worker(s) {', '.join(dead)} died before shutdown ({tag})")
            if time.monotonic() > deadline:
                names = ", ".join(repr(agent.addresses[r].name) for r in missing)
                raise ShutdownError(f"shutdown timed out waiting for {names} ({tag})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _is_lost(self, rank: int) -> bool:
        peers = self._agent.peers
        return peers is not None and rank in peers.peers and peers.is_lost(rank)

    async def _release_store(self, deadline: float) -> None:
        # Rank 0 hosts the TCPStore: it waits until everyone has left the last barrier,
        # so nobody polls a store that has already gone away.
        agent = self._agent
        group = agent.group
        if group is None or agent.world_size <= 1:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, group.arrive, "left")
        if agent.rank != 0:
            return
        limit = min(deadline, time.monotonic() + 5.0)
        while await loop.run_in_executor(None, group.missing, "left"):
            if time.monotonic() > limit:
                return
            await asyncio.sleep(_POLL_S)

    def close(self) -> None:
        if self._loopback is not None:
            self._loopback.close()
