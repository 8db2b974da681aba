"""Graceful shutdown: rounds of work separated by store barriers (layer L2.3).

Graceful shutdown runs in rounds separated by store barriers: (1) every worker finishes
its own outstanding calls; (2) every worker releases its user RRefs and waits for the
owners to hear of it; (3) owners drain their deletes and report leaks; then connections
close. As in torch, the rounds wait without limit by default: a worker that calls
``shutdown()`` right after joining serves its peers for as long as they run. A bound is
opt-in (``ShutdownTimeoutError`` names where it comes from).

A barrier's news travels over peer connections, not the store: the worker whose
arrival completes it sends ``BarrierOpened`` down a tree of workers (``tree.py``), and a
waiter asks the store only when no message came within a slice (a dead parent, a lost
frame): an arrival and, mostly, nothing else (docs/scale.md). A worker passes the news on
as it arrives, on the loop, not when its own wait wakes up: that wait may be in a store
request just then, and a tree whose every level waited so would hold the news for a
request per level (its leaves would look in the store before it came).

A worker that died is left out: a barrier stops waiting for a missing worker once it is
declared lost (its connection broke and redials were refused, its heartbeats stopped), so
the survivors finish together. A worker still missing after ``PROBE_AFTER_S`` is probed
(dialled): a dead one, even one never contacted, refuses and is declared lost within a
fraction of a second. Each verdict is also written to the store, so that a survivor that
never reached the dead worker (a host that went away answers no dial) does not wait for
it either. The dead are reported once this worker has stopped (``lost_workers``).

A member of a dynamic group leaves on its own, as members join: no barrier waits for the
others (they may run on for long). It finishes its calls, releases its user RRefs, waits
while others still hold RRefs it owns (they release them, leave, or the deadline comes),
finishes the requests it runs, and marks itself left in the store; its Goodbye tells the
members connected to it. Rank 0, which hosts a TCPStore, first waits a little for the
members still there to leave, as in a static group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from asyncrpc.errors import (
    RemoteProtocolError,
    ShutdownError,
    ShutdownTimeoutError,
    WorkersLostError,
)
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import BarrierOpened
from asyncrpc.runtime.group.join import Group
from asyncrpc.runtime.group.tree import children, neighbours, recipients

__all__ = [
    "PROBE_AFTER_S",
    "BarrierNews",
    "GracefulShutdown",
    "Liveness",
    "Releasing",
    "shutdown_limit",
]
_log = logging.getLogger(__name__)
_POLL_S = 0.005
# A wait polls fast at first (a healthy group's barriers take milliseconds), then backs
# off: a worker serving its peers for hours from inside shutdown() costs the store a few
# reads a second, not two hundred.
_MAX_POLL_S = 0.25
# How long a barrier waits for a missing worker before probing it: long enough that a
# healthy group (its barriers take milliseconds) opens no connection for it; probes then
# space out to _MAX_PROBE_S. A barrier waits in slices that grow to _MAX_SLICE_S, so
# that a worker serving its peers for hours from inside shutdown() sends the store a
# request every two seconds (and its other store requests wait behind a slice at most:
# barriers.py), and sees its own verdicts on lost peers within a slice. A slice is also
# how long a waiter trusts the BarrierOpened messages before it checks the store once: in
# a healthy group they come within milliseconds of the last arrival.
PROBE_AFTER_S = 1.0
_MAX_PROBE_S = 8.0
_FIRST_SLICE_S = 0.5
_MAX_SLICE_S = 2.0
# The graceful shutdown's barriers, in order ("left" is only rank 0's wait).
TAGS = ("calls-done", "users-released", "closing")
# The root of every barrier's tree: the same tree each time, so that a worker connects to
# the same three peers at most, whose addresses it reads once (_meet_neighbours). The
# worker that completes a barrier tells rank 0, which every worker knows from the join.
_ROOT = 0


def shutdown_limit(timeout: float | None) -> float | None:
    """The bound of a graceful shutdown in seconds, or None for no limit (None or 0).

    Raises:
        ValueError: ``timeout`` is negative.
    """
    if timeout is None or timeout == 0:
        return None
    if not timeout > 0:
        raise ValueError(f"a shutdown timeout must be >= 0 seconds (0: no limit), got {timeout}")
    return float(timeout)


class Releasing(Protocol):
    """What the rounds ask of the RRef layer (above the runtime): its user references
    released, its owned values no longer held elsewhere."""

    def release_all_users(self) -> None:
        """Release every user RRef this worker holds."""

    def quiescent(self) -> bool:
        """Whether the owners have heard of every release (nothing is in flight)."""

    def owner_leaks(self) -> list[Any]:
        """Owned values other workers still reference."""

    def report_leaks(self) -> None:
        """Say (as ``rref_leaks`` asks) which owned values are still referenced.

        Raises:
            ShutdownError: some are, and ``rref_leaks`` is "error".
        """


class Liveness(Protocol):
    """What the rounds ask of the network about the workers a barrier waits for."""

    def is_lost(self, rank: int) -> bool: ...

    def is_connected(self, rank: int) -> bool: ...

    def probe(self, rank: int) -> None:
        """Dial ``rank`` if not connected: it is declared lost if it refuses (no wait)."""

    def control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        """Write a bookkeeping frame to ``rank``, connecting first when ``connect``."""

    def unsent(self, ranks: list[int]) -> bool:
        """Whether frames for any of ``ranks`` still wait for their connection."""


class BarrierNews:
    """The ``BarrierOpened`` messages this worker received, the first one per barrier;
    on the agent's loop."""

    def __init__(self) -> None:
        self._messages: dict[str, BarrierOpened] = {}
        self._heard: dict[str, asyncio.Event] = {}
        # Passes a barrier's first message on as it comes (GracefulShutdown._relay).
        self.relay: Callable[[BarrierOpened], None] | None = None

    def heard(self, message: BarrierOpened, size: int | None) -> None:
        """Take ``message`` from a peer of a group of ``size`` workers: the first one per
        barrier wakes its waiter and goes to ``relay``; a later one is dropped.

        Raises:
            RemoteProtocolError: it names no shutdown barrier, or a root outside the group
                (the peer sent garbage).
        """
        if message.tag not in TAGS or size is None or not 0 <= message.root < size:
            raise RemoteProtocolError(f"no such barrier of {size} workers: {message!r}")
        if message.tag in self._messages:
            return
        self._messages[message.tag] = message
        self._event(message.tag).set()
        if self.relay is not None:
            self.relay(message)

    def get(self, tag: str) -> BarrierOpened | None:
        """The message that told this worker ``tag`` is open, if one came."""
        return self._messages.get(tag)

    def _event(self, tag: str) -> asyncio.Event:
        return self._heard.setdefault(tag, asyncio.Event())

    async def wait(self, tag: str, seconds: float) -> BarrierOpened | None:
        """The message that told this worker ``tag`` is open, waiting at most ``seconds``
        for it; None if none came. Cancelling it only stops the wait."""
        if tag not in self._messages:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event(tag).wait(), seconds)
        return self._messages.get(tag)


class _Clock:
    """The deadline of one shutdown: none, or ``limit`` seconds from its start."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.at = None if limit is None else time.monotonic() + limit

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at

    def within(self, seconds: float) -> float:
        """A deadline ``seconds`` from now, or this one's if it comes first."""
        soon = time.monotonic() + seconds
        return soon if self.at is None else min(soon, self.at)

    def expired(self, waiting_for: str, stage: str) -> ShutdownTimeoutError:
        assert self.limit is not None
        return ShutdownTimeoutError(self.limit, waiting_for, stage)


class GracefulShutdown:
    """The graceful-shutdown protocol of one agent.

    Args:
        group: the group the barriers are among (its store holds them).
        rrefs: the RRef layer's references (released in round 2, leaks in round 3).
        liveness: which workers are lost or connected, and dialling them.
        calls_in_flight: how many calls this worker still waits for.
        requests_running: how many requests it still runs for others.
        news: the ``BarrierOpened`` messages received (the agent's; a new one by default).

    ``dead`` names the workers it stopped waiting for because they died, by rank;
    ``opened`` says how each barrier opened here ("told by a peer", "completed here",
    "found open in the store").
    """

    def __init__(
        self, group: Group, *, rrefs: Releasing, liveness: Liveness,
        calls_in_flight: Callable[[], int], requests_running: Callable[[], int],
        news: BarrierNews | None = None,
    ) -> None:  # fmt: skip
        self._group, self._rrefs, self._liveness = group, rrefs, liveness
        self._told: list[int] = []  # whom this worker passed its last news to
        self._relayed: set[str] = set()  # the barriers whose news it passed on
        self._news = BarrierNews() if news is None else news
        self._news.relay = self._relay
        self.opened: dict[str, str] = {}  # how each barrier opened here (tests, logs)
        self._calls_in_flight, self._requests_running = calls_in_flight, requests_running
        self.dead: dict[int, str] = {}

    async def run(self, limit: float | None) -> None:
        """Run the shutdown rounds, for at most ``limit`` seconds (None: no limit).

        Raises:
            ShutdownTimeoutError: the limit ran out.
            ShutdownError: the rendezvous store is unreachable (its host died).
        """
        clock = _Clock(limit)
        if self._group.dynamic:
            await self._leave(clock)
            return
        await _until(lambda: self._calls_in_flight() == 0, clock, "this worker's own calls")
        await self._barrier("calls-done", clock)
        rrefs = self._rrefs
        rrefs.release_all_users()
        await _until(rrefs.quiescent, clock, "the owners of its user RRefs")
        await self._barrier("users-released", clock)
        # Deletes sent before the barrier may still be on the wire: give them a moment.
        await _until(lambda: not rrefs.owner_leaks(), _Clock(1.0), None)
        rrefs.report_leaks()
        await _until(lambda: self._requests_running() == 0, clock, "requests it runs")
        await self._barrier("closing", clock)
        # The last news this worker passed on may still wait for its connection (a peer
        # never called before): closing now would drop it, and that subtree would look
        # at the store only after a slice. Let it leave first (briefly: best effort).
        told = self._told
        await _until(lambda: not self._liveness.unsent(told), _Clock(_FIRST_SLICE_S), None)
        await self._release_store(clock)

    def report_dead(self, policy: str) -> None:
        """Tell of the workers that died, as ``policy`` (``lost_workers``) says.

        Raises:
            WorkersLostError: some died and ``policy`` is "error".
        """
        if not self.dead or policy == "ignore":
            return
        error = WorkersLostError(tuple(self.dead[r] for r in sorted(self.dead)))
        if policy == "error":
            raise error
        _log.warning("worker %r: %s", self._group.name, error)

    async def _leave(self, clock: _Clock) -> None:
        """Leave a dynamic group: this member's own rounds, no barrier."""
        await _until(lambda: self._calls_in_flight() == 0, clock, "this worker's own calls")
        rrefs = self._rrefs
        rrefs.release_all_users()
        await _until(rrefs.quiescent, clock, "the owners of its user RRefs")
        # Holders release them, or leave (then their forks are dropped when they are
        # declared lost); a holder that runs on past the deadline leaks them. Without a
        # deadline a member waits for as long as they hold them.
        await _until(lambda: not rrefs.owner_leaks(), clock, None)
        rrefs.report_leaks()
        await _until(lambda: self._requests_running() == 0, clock, "requests it runs")
        await self._release_store(clock)

    async def _barrier(self, tag: str, clock: _Clock) -> None:
        # Longer than 40 lines: the one loop of a barrier's wait (news, store, verdicts,
        # probes, the clock) reads best in one place.
        store = self._group.store
        size = self._group.world_size
        if size is None or size <= 1:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, store.reach, tag)
        await self._count_dead(tag, sorted(self.dead))  # known dead from earlier rounds
        if tag == TAGS[0]:
            await self._meet_neighbours(size)
        waiting = [r for r in range(size) if r not in self.dead]
        slice_s, probe_every = _FIRST_SLICE_S, PROBE_AFTER_S
        probe_at = time.monotonic() + probe_every
        while True:  # bounded by the clock, or by every live worker arriving
            if tag in store.opened_here:  # this worker's arrival (or count) completed it
                dead = store.opened_here[tag]
                if dead:
                    await self._adopt_verdicts()
                self._tell(BarrierOpened(tag, _ROOT, dead), first=True)
                self._opened(tag, "completed here")
                return
            # A message down the tree, or else (a dead parent, a lost frame) one look at
            # the store at the slice's end.
            seconds = max(0.0, clock.within(slice_s) - time.monotonic())
            message = await self._news.wait(tag, seconds)
            if message is not None:
                await self._told_by(message)
                return
            if await loop.run_in_executor(None, store.await_arrivals, tag, waiting, 0.0):
                message = self._news.get(tag)  # it may have come during the request
                await (self._found_open(tag) if message is None else self._told_by(message))
                return
            # This worker's own verdicts cost no store request (unless one is lost).
            await self._set_aside_lost(tag, waiting)
            waiting = [r for r in waiting if r not in self.dead]
            if clock.passed():
                missing = await loop.run_in_executor(None, store.missing, tag, waiting)
                raise clock.expired(self._names(missing), tag)
            if time.monotonic() > probe_at:
                # Which workers are missing is read only now and then (a read per 62
                # ranks): to dial them, and to adopt other survivors' verdicts.
                waiting = await self._waiting_for(tag, waiting)
                if not waiting and tag not in store.opened_here:
                    await self._found_open(tag)
                    return
                await self._probe(tag, waiting)
                probe_every = min(probe_every * 2, _MAX_PROBE_S)
                probe_at = time.monotonic() + probe_every
                slice_s = _FIRST_SLICE_S  # a refused dial's verdict comes in milliseconds
                continue
            slice_s = min(slice_s * 2, _MAX_SLICE_S)

    async def _told_by(self, message: BarrierOpened) -> None:
        """A peer said barrier ``message.tag`` is open: pass the news on (done already as
        it came, unless it says a rank was counted dead)."""
        if message.dead:
            # A rank was counted dead there: learn which now (one request), to tell its
            # children in its place and count it at the next barriers.
            await self._adopt_verdicts()
        self._tell(message)
        self._opened(message.tag, "told by a peer")

    def _relay(self, message: BarrierOpened) -> None:
        """``BarrierNews.relay``: pass news on as it comes, on the loop. Not news that a
        rank was counted dead: who died is read first (``_told_by``), to tell its
        children in its place."""
        if not message.dead:
            self._tell(message)

    def _opened(self, tag: str, how: str) -> None:
        self.opened[tag] = how
        _log.debug("worker %r: barrier %r open: %s", self._group.name, tag, how)

    async def _meet_neighbours(self, size: int) -> None:
        """Read the addresses of this worker's parent and children in the tree, those it
        does not know, in one request: a first frame between two workers that never
        talked would cost each a look-up (the dial's and the Hello's), per peer. Then
        dial the children while the first barrier waits."""
        group = self._group
        unknown = [r for r in neighbours(group.rank, _ROOT, size) if r not in group.addresses]
        if unknown:
            store, loop = group.store, asyncio.get_running_loop()
            try:
                found = await loop.run_in_executor(None, store.find_all, unknown)
            except (RuntimeError, OSError) as exc:
                raise store.unreachable(exc) from exc
            for address in found:
                group.directory.learn(address)
        # The news goes down the tree through connections a parameter-server job's
        # workers may never have opened: dialled only when the news comes, one level
        # after another, they cost a handshake per level on the news's way (a loaded
        # host's seconds at depth 3). These are the tree's own connections (each parent
        # dials its children: no more than the news would open), and a dead child is
        # found now rather than a probe interval into the barrier.
        for child in children(group.rank, _ROOT, size):
            self._liveness.probe(child)

    async def _found_open(self, tag: str) -> None:
        """Barrier ``tag`` was found open in the store, no message having come (a dead
        parent, a frame still on its way): learn who died (one request; nobody said) and
        tell this worker's children all the same, as its parent would have."""
        lost = await self._adopt_verdicts()
        self._tell(BarrierOpened(tag, _ROOT, bool(lost)))
        self._opened(tag, "found open in the store")

    def _tell(self, message: BarrierOpened, first: bool = False) -> None:
        """Pass on ``message`` (a barrier is open), once per barrier: to this worker's
        children in the tree rooted at ``message.root``, skipping the dead (their
        children are told); when this worker completed the barrier (``first``), to the
        root too (the tree stays the same at every barrier: each pair of workers connects
        once). The news the root sends down reaches this worker again, and stops here."""
        if message.tag in self._relayed:
            return
        self._relayed.add(message.tag)
        size = self._group.world_size
        assert size is not None
        pieces = encode_frame(message.to_fields(), b"")
        me = self._group.rank
        told = recipients(me, message.root, size, self.dead)
        if first and me != message.root:
            told = [message.root, *told]
        self._told = told
        for rank in told:
            # Connecting if need be: a parameter-server job's workers may never have
            # talked. A frame lost to a dying peer is the fallback's: its subtree looks
            # at the store after a slice.
            self._liveness.control(rank, pieces, connect=True)

    async def _count_dead(self, tag: str, ranks: list[int]) -> None:
        """Count the dead ``ranks`` at barrier ``tag`` (once, whoever counts first), so
        that the barrier opens for the survivors."""
        store, loop = self._group.store, asyncio.get_running_loop()
        for rank in ranks:
            await loop.run_in_executor(None, store.count_dead, tag, rank)

    async def _set_aside_lost(self, tag: str, among: list[int]) -> None:
        """Set aside the workers of ``among`` this worker found dead, unless they reached
        barrier ``tag`` before dying (then they are not waited for anyway)."""
        liveness, loop = self._liveness, asyncio.get_running_loop()
        lost = [r for r in among if r not in self.dead and liveness.is_lost(r)]
        if not lost:
            return
        # A peer may have arrived and then closed its connections (it left: not dead):
        # it is dead only if still missing.
        store = self._group.store
        still = set(await loop.run_in_executor(None, store.missing, tag, lost))
        for rank in (r for r in lost if r in still):
            await self._set_aside(rank, tag)
            # Named before it is counted: whoever the count lets through (the count flags
            # the barrier as having a dead rank) then finds it in the list.
            await loop.run_in_executor(None, store.declare_lost, rank)
            await self._count_dead(tag, [rank])

    async def _waiting_for(self, tag: str, among: list[int]) -> list[int]:
        """The live workers of ``among`` that have not reached barrier ``tag``; the dead
        ones found missing are set aside (and named in the store)."""
        loop = asyncio.get_running_loop()
        missing: list[int] = await loop.run_in_executor(None, self._group.store.missing, tag, among)
        await self._set_aside_lost(tag, missing)
        return [r for r in missing if r not in self.dead]

    async def _probe(self, tag: str, missing: list[int]) -> None:
        """Dial the workers missing for long; adopt (and count at barrier ``tag``) the
        verdicts other survivors stored about those this worker has no live connection to."""
        liveness, loop = self._liveness, asyncio.get_running_loop()
        for rank in missing:
            liveness.probe(rank)
        declared = await loop.run_in_executor(None, self._group.store.declared_lost, missing)
        for rank in declared:
            if not liveness.is_connected(rank):
                await self._set_aside(rank, "declared lost by another worker")
                await self._count_dead(tag, [rank])

    async def _adopt_verdicts(self) -> list[int]:
        """Learn the dead that other survivors counted (a barrier may open for this worker
        without it finding them dead itself); all the ranks declared lost. One request
        when none died. Read only when a barrier's message says some rank was counted
        dead there, or a barrier opened without a message."""
        loop = asyncio.get_running_loop()
        lost: list[int] = await loop.run_in_executor(None, self._group.store.lost_ranks)
        for rank in lost:
            if rank not in self.dead:
                await self._set_aside(rank, "declared lost by another worker")
        return lost

    async def _set_aside(self, rank: int, why: str) -> None:
        name = await self._name(rank)
        self.dead[rank] = name
        _log.info("worker %r: not waiting for %r: it died (%s)", self._group.name, name, why)

    async def _name(self, rank: int) -> str:
        """``rank``'s name, looked up in the store (off the loop) if not met yet."""
        group = self._group
        if rank not in group.addresses:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, group.directory.lookup, rank)
        address = group.addresses.get(rank)
        return address.name if address is not None else f"rank {rank}"

    def _names(self, ranks: list[int]) -> str:
        addresses = self._group.addresses
        return ", ".join(repr(addresses[r].name) if r in addresses else f"rank {r}" for r in ranks)

    async def _release_store(self, clock: _Clock) -> None:
        # Rank 0 hosts the TCPStore: it waits until everyone still alive has left the last
        # barrier, so nobody polls a store that has already gone away.
        store = self._group.store
        if self._group.world_size is not None and self._group.world_size <= 1:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, store.reach, "left")
        except ShutdownError:  # the store is unreachable (arrive names its host)
            if not store.dynamic:
                raise
            return  # rank 0 has left and its TCPStore with it: nobody is left to tell
        if self._group.rank != 0:
            return
        limit = clock.within(5.0)
        await self._count_dead("left", sorted(self.dead))
        # Who has not left yet (in a dynamic group, of the members listed now).
        missing = await loop.run_in_executor(None, store.missing, "left")
        waiting = [r for r in missing if r not in self.dead]
        while waiting:  # bounded by the limit
            seconds = max(0.0, min(PROBE_AFTER_S, limit - time.monotonic()))
            if await loop.run_in_executor(None, store.await_arrivals, "left", waiting, seconds):
                return
            waiting = await self._waiting_for("left", waiting)
            if time.monotonic() > limit:
                return


async def _until(condition: Callable[[], bool], clock: _Clock, what: str | None) -> None:
    """Wait until ``condition`` holds; past the clock, raise (``what`` names the wait)
    or, for a best-effort wait (``what`` None), return."""
    delay = _POLL_S
    while not condition():  # bounded by the clock, or by the work it waits for ending
        if clock.passed():
            if what is None:
                return
            raise clock.expired(what, "finishing")
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)
