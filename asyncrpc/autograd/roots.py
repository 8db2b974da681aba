"""The thread that called ``backward()`` runs the hops that come back to it (layer L3).

A pass often comes back to its root: the root sent the tensors of the forward pass, so the
gradients of those tensors return there (client -> server -> client for one remote layer
whose input requires grad). The root's thread waits for the pass meanwhile. Where the loop
ran such a hop's local pass itself, the thread woke after it: the loop then still held the
GIL, finishing the hop's reply, and the thread waited for it (bench/RESULTS.md, "One
backward hop"). Here the loop hands the hop to the waiting thread instead: the thread
wakes once, for the hop, runs its pass (user code such as tensor hooks may run there: it
is the user's own thread) and, when it holds the last credit, returns at once.

The loop hands a hop over only while the thread serves its pass; once the thread stops
(the pass is over, or failed), hops still arriving run on the loop or the pool as others.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from asyncrpc.runtime.futures import Future, add_hook
from asyncrpc.runtime.threads.blocking import blocking

__all__ = ["RootThreads"]

# What a thread runs for a hop: it completes the hop's own future, and never raises.
Work = Callable[[], None]


class RootThreads:
    """The threads of this worker waiting in ``backward()``, by the id of their pass."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[int, queue.SimpleQueue[Work | None]] = {}
        self.hops_taken = 0  # hops run by the thread that waited for their pass

    def open(self, pass_id: int) -> None:
        """The calling thread will ``serve`` pass ``pass_id``: hops may be posted from now."""
        with self._lock:
            self._boxes[pass_id] = queue.SimpleQueue()

    def post(self, pass_id: int, work: Work) -> bool:
        """Hand ``work`` to the thread serving ``pass_id``; False (not taken) when no
        thread does, or no longer: then the caller runs it."""
        with self._lock:
            box = self._boxes.get(pass_id)
            if box is None:
                return False
            self.hops_taken += 1
            box.put(work)
        return True

    def serve(self, pass_id: int, done: Future[Any]) -> None:
        """Run the work posted for ``pass_id`` on the calling thread until ``done`` is
        done; then stop taking work and run what was posted before that. Returns with
        ``done`` done (its outcome is the caller's to read)."""
        with self._lock:
            box = self._boxes[pass_id]
        add_hook(done, lambda _: box.put(None))
        try:
            with blocking():  # a pool thread waiting here lets its pool start a stand-in
                # Bounded by the hops of the pass: each posts one item, and `done` one None.
                while (work := box.get()) is not None:
                    work()
        finally:
            self.close(pass_id)
            _run_left(box)

    def away(self, pass_id: int) -> queue.SimpleQueue[Work | None] | None:
        """The thread serving ``pass_id`` is blocked elsewhere (a lane call) until
        ``back``: hops posted meanwhile are refused (run elsewhere). Returns what ``back``
        takes. Two plain calls, not a context manager: this is on every root's hop."""
        with self._lock:
            return self._boxes.pop(pass_id, None)

    def back(self, pass_id: int, box: queue.SimpleQueue[Work | None] | None) -> None:
        """The thread ``away`` from ``pass_id`` takes its hops again."""
        if box is not None:
            with self._lock:
                self._boxes[pass_id] = box

    def finish(self, pass_id: int) -> None:
        """``serve`` for a pass already over: stop taking work for ``pass_id``, and run
        what was posted before (nothing, as a rule: see ``engine.root_onward``)."""
        with self._lock:
            box = self._boxes.pop(pass_id, None)
        if box is not None:
            _run_left(box)

    def close(self, pass_id: int) -> None:
        """Stop taking work for ``pass_id`` (hops arriving later run elsewhere)."""
        with self._lock:
            self._boxes.pop(pass_id, None)


def _run_left(box: queue.SimpleQueue[Work | None]) -> None:
    # Posted before the thread stopped taking work: their callers wait for their replies.
    # Bounded: nothing is posted to a closed box (only serve's own None may still come).
    while not box.empty():
        work = box.get_nowait()
        if work is not None:
            work()
