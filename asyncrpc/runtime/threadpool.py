"""The thread pool that runs synchronous remote functions for one agent (layer L2).

Jobs reach daemon threads through one ``queue.SimpleQueue``; what the threads hand back to
the agent's loop goes through one deque, and a burst of completions costs the loop a single
wake-up. ``concurrent.futures.ThreadPoolExecutor`` spent about half of a busy server's CPU
on its own bookkeeping (a Future, a Condition and a semaphore per job, one wake-up each).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from asyncrpc.errors import ClosedError

__all__ = ["Job", "WorkerPool"]

_log = logging.getLogger("asyncrpc.runtime.threadpool")


class Job:
    """A submitted function call; ``cancel()`` drops it if no thread has started it.

    ``dropped``, if set, is posted to the loop when shutdown drops the job unrun.
    """

    __slots__ = ("args", "cancelled", "dropped", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.cancelled = False
        self.dropped: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.cancelled = True


class WorkerPool:
    """At most ``size`` threads, started on demand, running jobs in submission order.

    A thread is started whenever the queued jobs outnumber the idle threads, so a job never
    waits behind one that blocks while the pool is below its size (a function waiting for
    a later call to set an event does not deadlock). Jobs reply to the loop with ``post``.
    """

    def __init__(self, size: int, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self.size = size
        self._loop = loop
        self._name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._wakeup_pending = False
        self._lock = threading.Lock()  # guards the counts below
        self._threads = 0
        self._idle = 0
        self._queued = 0
        self._busy = 0
        self._running = 0  # threads that have not exited
        self._closed = False

    @property
    def busy(self) -> int:
        """Threads running a job right now."""
        return self._busy

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        """Queue ``fn(*args)`` for a pool thread.

        Raises:
            ClosedError: the pool was shut down, or no thread can be started (the
                interpreter is exiting).
        """
        if self._closed:
            raise ClosedError(f"the thread pool of worker {self._name!r} is shut down")
        job = Job(fn, args)
        with self._lock:
            self._queued += 1
            start = self._queued > self._idle and self._threads < self.size
            if start:
                self._threads += 1
                self._running += 1
                self._idle += 1
        self._jobs.put(job)
        if start:
            try:
                self._start_thread()
            except RuntimeError as exc:  # "can't create new thread at interpreter shutdown"
                with self._lock:
                    self._threads -= 1
                    self._running -= 1
                    self._idle -= 1
                job.cancel()
                raise ClosedError(f"worker {self._name!r} cannot start a thread: {exc}") from exc
        return job

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop (from any thread); completions are batched."""
        self._done.append((callback, args))
        if self._wakeup_pending:
            return  # the loop will drain this entry with the ones before it
        self._wakeup_pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the agent is gone, nobody reads replies
            self._done.clear()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on a pool thread and return (or raise) what it did."""
        future = self._loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return  # the awaiting task was cancelled
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> None:
            try:
                value = fn(*args)
            except BaseException as exc:
                self.post(settle, False, exc)
                return
            self.post(settle, True, value)

        job = self.submit(work)
        job.dropped = functools.partial(
            settle, False, ClosedError(f"the thread pool of worker {self._name!r} shut down")
        )
        try:
            return await future
        finally:
            job.cancel()

    def shutdown(self) -> None:
        """Stop taking jobs; drop the queued ones; let idle threads exit (never waits)."""
        if self._closed:
            return
        self._closed = True
        while True:  # bounded: nothing is queued once closed
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._drop(job)
        for _ in range(self._threads):
            self._jobs.put(None)

    def _drop(self, job: Job) -> None:
        if not job.cancelled and job.dropped is not None:
            self.post(job.dropped)

    async def stopped(self, timeout: float) -> bool:
        """After ``shutdown``: wait up to ``timeout`` s for the threads to exit.

        Threads still running a job when the interpreter exits are daemon threads caught
        mid-way; waiting for the idle ones here lets them leave cleanly. A job that blocks
        forever is not waited for beyond ``timeout``.

        Returns:
            True when every thread has exited.
        """
        deadline = self._loop.time() + timeout
        delay = 0.001
        while self._running and self._loop.time() < deadline:  # bounded by the deadline
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return not self._running

    def _drain(self) -> None:
        # Clear the flag before draining: an entry appended after this point either is
        # drained below or sees the flag clear and schedules another drain.
        self._wakeup_pending = False
        done = self._done
        try:
            for _ in range(len(done)):  # bounded: later entries wait for the next drain
                callback, args = done.popleft()
                try:
                    callback(*args)
                except Exception as exc:  # one failing callback must not strand the rest
                    self._loop.call_exception_handler(
                        {"message": f"asyncrpc: {callback!r} failed", "exception": exc}
                    )
        finally:  # a KeyboardInterrupt mid-way: what is left gets another drain
            if done and not self._wakeup_pending:
                self._wakeup_pending = True
                self._loop.call_soon(self._drain)

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._work, name=f"asyncrpc-{self._name}-{self._threads}", daemon=True
        )
        thread.start()

    def _work(self) -> None:
        try:
            self._take_jobs()
        finally:
            with self._lock:
                self._running -= 1

    def _take_jobs(self) -> None:
        jobs, lock = self._jobs, self._lock
        while True:  # until shutdown's sentinel or a job taken after shutdown
            job = jobs.get()
            if job is None:
                return
            if self._closed:
                self._drop(job)
                return
            with lock:
                self._queued -= 1
                self._idle -= 1
                self._busy += 1
            if not job.cancelled:
                try:
                    job.fn(*job.args)
                except BaseException:  # jobs report their own errors; keep the thread
                    _log.exception("asyncrpc: a pool job of %s raised", self._name)
            # Drop the arguments now, not at the next job: an idle thread must not keep
            # them (an RRef among them would never be released).
            del job
            with lock:
                self._busy -= 1
                self._idle += 1
