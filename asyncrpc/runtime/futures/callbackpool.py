"""The callback pool: threads that run callbacks registered from synchronous code, woken
once per batch rather than once per completed future (layer L2.02).

Such callbacks may block (torch runs callbacks on its RPC threads, where waiting on
another future is allowed), so they never run on the agent's loop. The loop completes many
futures in one turn under load; a thread pool that is handed each one separately pays a
thread wake-up per future. Here jobs join one queue, and the loop wakes a thread only when
none is awake to take them: an awake thread runs job after job without another hand-off.

A callback that blocks must not hold up the jobs behind it (one of them may be what it
waits for). While jobs wait and no job has finished for ``STALL_S``, the loop wakes one
more thread (up to ``size``), as often as that stays true: a blocked callback delays the
others by about that long, never forever while threads are left.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from asyncrpc.runtime.threads import handoffs

__all__ = ["CallbackPool"]

STALL_S = 0.002  # no job finished for this long while jobs wait: wake one more thread

Job = tuple[Callable[[Any], None], Any]


class CallbackPool:
    """Runs ``invoke(arg)`` jobs on up to ``size`` threads, in submission order per thread."""

    def __init__(self, size: int, name: str = "asyncrpc-callback", stall: float = STALL_S) -> None:
        self.size = size
        self.stall = stall
        self._name = name
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0  # threads waiting on _wake
        self._awake = 0  # threads woken (or started) that have not gone idle again
        self._finished = 0  # jobs run so far: a stall is no progress while jobs wait
        self._watching = False  # a stall check is scheduled on a loop
        self.wakeups = 0  # threads woken or started (for tests and metrics)

    def submit(self, invoke: Callable[[Any], None], arg: Any) -> None:
        """Queue a job; wake a thread if none is awake to take it (any thread may call)."""
        with self._lock:
            self._jobs.append((invoke, arg))
            if self._awake == 0:
                self._start_or_wake()
            watch = not self._watching
        if watch:
            self._watch_for_stalls()

    def _start_or_wake(self) -> None:
        # Under the lock. With every thread busy, the first one free takes the job.
        if self._idle:
            self._idle -= 1
            self._wake.notify()
        elif self._threads < self.size:
            self._threads += 1
            threading.Thread(
                target=self._work, name=f"{self._name}-{self._threads}", daemon=True
            ).start()
        else:
            return
        self._awake += 1
        self.wakeups += 1
        handoffs.count("to_callback_pool")

    def run_left_over(self) -> None:
        """Run, on this thread, the jobs no pool thread took (at interpreter exit: the
        pool's threads are daemons, so nothing queued is lost with them)."""
        for _ in range(1_000_000):  # a job may queue more
            with self._lock:
                if not self._jobs:
                    return
                invoke, arg = self._jobs.popleft()
            invoke(arg)

    def _work(self) -> None:
        lock = self._lock
        jobs = self._jobs
        while True:  # a pool thread: runs until the process ends
            with lock:
                while not jobs:
                    self._awake -= 1
                    self._idle += 1
                    self._wake.wait()  # _start_or_wake counted this thread awake again
                invoke, arg = jobs.popleft()
            try:
                invoke(arg)
            finally:
                with lock:
                    self._finished += 1

    # -- stalls ----------------------------------------------------------------------------

    def _watch_for_stalls(self) -> None:
        loop = asyncio._get_running_loop()
        if loop is None:
            return  # no loop here: nothing completes futures in batches on this thread
        with self._lock:
            if self._watching or not self._jobs:
                return
            self._watching = True
            loop.call_later(self.stall, self._check, loop, self._finished)

    def _check(self, loop: asyncio.AbstractEventLoop, finished_before: int) -> None:
        # On ``loop``, which scheduled it; goes on while jobs wait.
        with self._lock:
            if not self._jobs:
                self._watching = False
                return
            if self._finished == finished_before:  # jobs wait and none finished: stalled
                self._start_or_wake()
            loop.call_later(self.stall, self._check, loop, self._finished)

    def pending(self) -> int:
        return len(self._jobs)
