"""Releasing distributed autograd contexts on the workers they reached, in batches (layer L3).

Leaving a context drops it here at once, on the leaving thread (as torch's ``__exit__``
does), and queues a release for the workers it exchanged messages with. Releases ride along
on the next call this worker makes to each of those workers (a header field the autograd
hook adds), or, once they have waited ``BATCH_DELAY`` seconds without such a call, leave in
one call per worker for all the contexts queued meanwhile; each worker passes them on to
the workers it reached in turn. A training loop leaves a context per step: one release
call per worker per step cost the caller a thread hand-off and each server a wake-up and a
reply, on the step's critical path on a small machine. The timer sends only releases that
waited a whole ``BATCH_DELAY``: one that sent whatever was queued when it fired took, in a
loop of steps shorter than the delay, the releases the next step was about to carry (a
release call every 5 ms, measured). While releases are queued the timer stays armed on the
loop (one loop wake-up per ``BATCH_DELAY``, no hand-off from the leaving thread); with
none queued it stops. Contexts live on the other workers at most about twice
``BATCH_DELAY`` longer (nothing reads them after the step: torch releases them in the
background too). ``Releases`` is built with the contexts, the
hook and the rest of the distributed autograd feature (``feature.py``), from the calls and
the loop it uses.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from asyncrpc.autograd.context import ContextTable, current_context_id
from asyncrpc.errors import ConnectionLostError, RpcTimeoutError
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.ports import Calls, Loop

__all__ = ["BATCH_DELAY", "Releases"]

BATCH_DELAY = 0.02  # seconds a release waits for a call to carry it (and between timers)
_RELEASE_TRIES = 6  # backoff 0.05 s doubling: about 3 s of waits in all


class Releases:
    """The contexts left on one worker whose release on other workers is still to send.

    Args:
        rank: this worker's rank.
        table: its contexts.
        calls: the calls releases go in (``release_here`` on each worker).
        loop: the agent's loop (batches leave from it).
        is_lost: whether a rank is gone for good (its releases are not retried).
        release_here: the remote function that releases contexts on a worker.
    """

    def __init__(
        self, rank: int, table: ContextTable, calls: Calls, loop: Loop,
        is_lost: Callable[[int], bool], release_here: Callable[..., Any],
    ) -> None:  # fmt: skip
        self._rank = rank
        self._table = table
        self._calls, self._loop, self._is_lost = calls, loop, is_lost
        self._release_here = release_here
        self._lock = threading.Lock()  # left() runs on user threads, the flush on the loop
        self._queued: dict[int, list[int]] = {}  # peer -> context ids to release there
        self._since: dict[int, float] = {}  # peer -> when its oldest queued release came
        self._flush_armed = False
        self.carried = 0  # context ids that rode along on a call (see take_for)

    def left(self, context_id: int) -> None:
        """The context was left on this worker (any thread): drop it here now, and release
        it on the workers it reached with the next call to each, or the next batch."""
        context = self._table.pop(context_id)
        if context is None:
            return
        peers = context.peers - {self._rank}
        if peers:  # else it never left this worker: nothing to tell anybody
            self.queue({peer: [context_id] for peer in peers})

    def take_for(self, peer: int) -> list[int]:
        """The releases queued for ``peer``, taken to ride along on a call to it (any
        thread): a training loop's next step calls the same workers, so its releases
        cost no call of their own. Queue them again (``queue``) if that call fails."""
        with self._lock:
            taken = self._queued.pop(peer, [])
            self._since.pop(peer, None)
            self.carried += len(taken)
        return taken

    def queue(self, by_peer: dict[int, list[int]]) -> None:
        """Release the context ids listed for each peer with the next call to it, or the
        next batch: contexts left here or passed on by this worker, and releases whose call
        failed (queued again: releasing twice is harmless)."""
        now = time.monotonic()
        with self._lock:
            for peer, context_ids in by_peer.items():
                if peer not in self._queued:
                    self._since[peer] = now
                self._queued.setdefault(peer, []).extend(context_ids)
            if self._flush_armed:
                return
            self._flush_armed = True
        self._loop.run_on_loop(self._arm)

    def _arm(self) -> None:
        self._loop.aio.call_later(BATCH_DELAY, self._flush)

    def _flush(self) -> None:
        # The timer, on the loop: what waited a whole delay goes; what is younger waits
        # for a call to carry it, the timer armed again behind it.
        now = time.monotonic()
        with self._lock:
            due = [peer for peer, since in self._since.items() if now - since >= BATCH_DELAY]
            queued = {peer: self._queued.pop(peer) for peer in due}
            for peer in due:
                del self._since[peer]
            self._flush_armed = bool(self._queued)
        if self._flush_armed:
            self._arm()
        self.send(queued)

    def flush(self) -> None:
        """Send everything queued now (on the loop; shutdown calls it before the goodbyes)."""
        with self._lock:
            queued, self._queued = self._queued, {}
            self._since.clear()
        self.send(queued)

    def onward(self, context_ids: Iterable[int], sender: int) -> None:
        """Drop the contexts here and pass each on to the workers it reached but the
        sender (queued like this worker's own releases: riding along on a call, or in a
        batch)."""
        released = []
        for context_id in context_ids:
            context = self._table.pop(context_id)
            if context is not None:  # else released already (a retry, or a second path here)
                released.append((context_id, sorted(context.peers - {sender, self._rank})))
        onward = _by_peer(released)
        if onward:
            self.queue(onward)

    def send(self, by_peer: dict[int, list[int]]) -> None:
        """Release contexts on each peer: one call per peer, in the background (on the loop)."""
        for peer, context_ids in by_peer.items():
            self._loop.aio.create_task(self._release_on(peer, context_ids))

    async def _release_on(self, peer: int, context_ids: list[int]) -> None:
        # A dropped connection is not a dead peer (connections heal): a release lost with
        # it is sent again on the next connection, or the peer would keep the contexts'
        # graphs and gradients for good (the chaos soak found one left behind). Releasing
        # is idempotent. Bounded: a peer declared lost, or our own shutdown, ends the retries.
        current_context_id.set(None)  # these calls are not part of any context
        calls = self._calls
        for attempt in range(_RELEASE_TRIES):
            try:
                args = (context_ids, self._rank)
                await calls.call(peer, self._release_here, args, {}, UNSET_RPC_TIMEOUT)
            except (ConnectionLostError, RpcTimeoutError):
                if calls.closed or self._is_lost(peer):
                    return
                await asyncio.sleep(0.05 * 2**attempt)
            except Exception:  # anything else is the peer's to report: not retried
                return
            else:
                return


def _by_peer(released: Iterable[tuple[int, Iterable[int]]]) -> dict[int, list[int]]:
    """``(context id, workers to tell)`` pairs as the context ids to release on each worker."""
    by_peer: dict[int, list[int]] = {}
    for context_id, peers in released:
        for peer in peers:
            by_peer.setdefault(peer, []).append(context_id)
    return by_peer
