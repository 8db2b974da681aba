"""Graceful shutdown: rounds of work separated by store barriers (layer L2).

Graceful shutdown runs in rounds separated by store barriers, each bounded by one
deadline: (1) every worker finishes its own outstanding calls; (2) every worker releases
its user RRefs and waits for the owners to hear of it; (3) owners drain their deletes and
report leaks; then connections close. A barrier fails fast, naming the peer, when a missing
worker is known to be lost, so a dead peer never hangs shutdown. A worker still missing after
``PROBE_AFTER_S`` is probed (dialled): a dead one, even one never contacted, refuses and is
declared lost within a fraction of a second.

A member of a dynamic group leaves on its own, as members join: no barrier waits for the
others (they may run on for long). It finishes its calls, releases its user RRefs, waits
while others still hold RRefs it owns (they release them, leave, or the deadline comes),
finishes the requests it runs, and marks itself left in the store; its Goodbye tells the
members connected to it. Rank 0, which hosts a TCPStore, first waits a little for the
members still there to leave, as in a static group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from asyncrpc.errors import ShutdownError
from asyncrpc.runtime.group.join import Group
from asyncrpc.runtime.services import RRefService

__all__ = ["PROBE_AFTER_S", "GracefulShutdown", "ShutdownHost"]
_POLL_S = 0.005
# How long a barrier waits for a missing worker before probing it: long enough that a
# healthy group (its barriers take milliseconds) opens no connection for it.
PROBE_AFTER_S = 1.0


class ShutdownHost(Protocol):
    """What the shutdown rounds read of their agent."""

    @property
    def group(self) -> Group: ...

    @property
    def rrefs(self) -> RRefService: ...

    def calls_in_flight(self) -> int: ...

    def requests_running(self) -> int: ...

    def is_lost(self, rank: int) -> bool: ...

    def probe(self, rank: int) -> None:
        """Dial ``rank`` if not connected: it is declared lost if it refuses (no wait)."""


class GracefulShutdown:
    """The graceful-shutdown protocol of one agent."""

    def __init__(self, agent: ShutdownHost) -> None:
        self._agent = agent

    async def run(self, deadline: float) -> None:
        """Run the shutdown rounds; raise ``ShutdownError`` if one cannot complete."""
        agent = self._agent
        if agent.group.dynamic:
            await self._leave(deadline)
            return
        await self._until(lambda: agent.calls_in_flight() == 0, deadline, "finishing own calls")
        await self._barrier("calls-done", deadline)
        rrefs = agent.rrefs
        rrefs.release_all_users()
        await self._until(rrefs.quiescent, deadline, "releasing user RRefs")
        await self._barrier("users-released", deadline)
        # Deletes sent before the barrier may still be on the wire: give them a moment.
        await self._until(
            lambda: not rrefs.owner_leaks(), min(deadline, time.monotonic() + 1.0), None
        )
        rrefs.report_leaks()
        await self._until(lambda: agent.requests_running() == 0, deadline, "finishing requests")
        await self._barrier("closing", deadline)
        await self._release_store(deadline)

    async def _leave(self, deadline: float) -> None:
        """Leave a dynamic group: this member's own rounds, no barrier."""
        agent = self._agent
        await self._until(lambda: agent.calls_in_flight() == 0, deadline, "finishing own calls")
        rrefs = agent.rrefs
        rrefs.release_all_users()
        await self._until(rrefs.quiescent, deadline, "releasing user RRefs")
        # Holders release them, or leave (then their forks are dropped when they are
        # declared lost); a holder that runs on past the deadline leaks them.
        await self._until(lambda: not rrefs.owner_leaks(), deadline, None)
        rrefs.report_leaks()
        await self._until(lambda: agent.requests_running() == 0, deadline, "finishing requests")
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
        group, addresses = agent.group.store, agent.group.addresses
        if agent.group.world_size is None or agent.group.world_size <= 1:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, group.arrive, tag)
        delay = _POLL_S
        probe_at = time.monotonic() + PROBE_AFTER_S
        while True:
            missing = await loop.run_in_executor(None, group.missing, tag)
            if not missing:
                return
            if time.monotonic() > probe_at:
                for rank in missing:
                    agent.probe(rank)
                probe_at = time.monotonic() + PROBE_AFTER_S
            lost = [r for r in missing if agent.is_lost(r)]
            if lost:
                # A peer may have arrived since the read above and then closed its
                # connections: it is dead only if the store still misses it now.
                still = set(await loop.run_in_executor(None, group.missing, tag))
                dead = [repr(addresses[r].name) for r in lost if r in still]
                if dead:
                    raise ShutdownError(f"worker(s) {', '.join(dead)} died before shutdown ({tag})")
            if time.monotonic() > deadline:
                names = ", ".join(repr(addresses[r].name) for r in missing)
                raise ShutdownError(f"shutdown timed out waiting for {names} ({tag})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _release_store(self, deadline: float) -> None:
        # Rank 0 hosts the TCPStore: it waits until everyone has left the last barrier,
        # so nobody polls a store that has already gone away.
        agent = self._agent
        group = agent.group.store
        if agent.group.world_size is not None and agent.group.world_size <= 1:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, group.arrive, "left")
        except (RuntimeError, OSError) as exc:
            if not group.dynamic:
                raise ShutdownError(f"the rendezvous store is unreachable: {exc}") from exc
            return  # rank 0 has left and its TCPStore with it: nobody is left to tell
        if agent.group.rank != 0:
            return
        limit = min(deadline, time.monotonic() + 5.0)
        while await loop.run_in_executor(None, group.missing, "left"):
            if time.monotonic() > limit:
                return
            await asyncio.sleep(_POLL_S)
