"""The thread pool that runs synchronous remote functions for one agent (layer L2.01).

Jobs reach daemon threads through one ``queue.SimpleQueue``; what the threads hand back to
the agent's loop goes through one deque, and a burst of completions costs the loop a single
wake-up. ``concurrent.futures.ThreadPoolExecutor`` spent about half of a busy server's CPU
on its own bookkeeping (a Future, a Condition and a semaphore per job, one wake-up each).

A pool thread blocked on an RPC future (``rpc_sync`` inside a remote function) does not
count against the pool's size: the pool starts a stand-in thread, up to a hard cap, so a
chain of nested blocking calls deeper than the pool completes. At the cap, with every
thread blocked, queued jobs fail with ``ThreadPoolExhaustedError`` instead of hanging.
Stand-ins that are no longer needed exit once their job is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from asyncrpc.errors import ClosedError, ThreadPoolExhaustedError
from asyncrpc.runtime.threads import handoffs
from asyncrpc.runtime.threads.blocking import set_blocking_host
from asyncrpc.runtime.threads.loopinbox import LoopInbox

__all__ = ["Job", "WorkerPool"]

_log = logging.getLogger(__name__)


class Job:
    """A submitted function call; ``cancel()`` drops it if no thread has started it.

    ``dropped``, if set, is posted to the loop when shutdown drops the job unrun;
    ``refused``, if set, is posted with the error when the exhausted pool refuses it.
    """

    __slots__ = ("args", "cancelled", "dropped", "fn", "refused")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.cancelled = False
        self.dropped: Callable[[], None] | None = None
        self.refused: Callable[[BaseException], None] | None = None

    def cancel(self) -> None:
        self.cancelled = True


class WorkerPool:
    """``size`` working threads, started on demand, running jobs in submission order.

    A thread is started whenever the queued jobs outnumber the idle threads, so a job never
    waits behind one that blocks while the pool is below its size (a function waiting for
    a later call to set an event does not deadlock). Threads blocked on an RPC future (see
    ``asyncrpc/runtime/threads/blocking.py``) are not counted: stand-ins start for them, up to
    ``max_threads`` threads in all. Jobs reply to the loop with ``post``.
    """

    def __init__(
        self, size: int, loop: asyncio.AbstractEventLoop, name: str, max_threads: int = 0
    ) -> None:
        self.size = size
        self.max_threads = max(size, max_threads)
        self._loop = loop
        self._name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._completions = LoopInbox(loop, "pool_to_loop")  # what post hands the loop
        self._lock = threading.Lock()  # guards the counts below
        self._threads = 0
        self._idle = 0
        self._queued = 0
        self._busy = 0
        self._blocked = 0  # threads waiting on an RPC future (they do not count as working)
        self._running = 0  # threads that have not exited
        self.refused = 0  # jobs refused because every thread, up to the cap, was blocked
        self._closed = False

    @property
    def busy(self) -> int:
        """Threads running a job right now."""
        return self._busy

    @property
    def threads(self) -> int:
        """Threads alive now (stand-ins included)."""
        return self._threads

    @property
    def blocked(self) -> int:
        """Threads waiting on an RPC future right now."""
        return self._blocked

    def statistics(self) -> dict[str, int]:
        """The pool's gauges, as ``get_metrics`` names them."""
        busy = self.busy
        return {
            "thread_pool_size": self.size,
            "thread_pool_busy": busy,
            "thread_pool_idle": self.size - busy,
            "thread_pool_threads": self.threads,
            "thread_pool_blocked": self.blocked,
            "thread_pool_refused": self.refused,
            # Jobs submitted that no thread has taken yet (the pool's queue).
            "thread_pool_queued": self._queued,
        }

    def _should_start(self) -> bool:
        # Under the lock. Blocked threads do not count against the size, only the cap.
        return (
            self._queued > self._idle
            and self._threads - self._blocked < self.size
            and self._threads < self.max_threads
        )

    def _exhausted(self) -> bool:
        # Under the lock: jobs wait, no thread may start, and none will free itself here.
        return (
            self._queued > self._idle
            and self._threads >= self.max_threads
            and self._blocked >= self._threads
        )

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        """Queue ``fn(*args)`` for a pool thread.

        Raises:
            ClosedError: the pool was shut down, or no thread can be started (the
                interpreter is exiting).
            ThreadPoolExhaustedError: all ``max_threads`` threads are blocked on RPC futures.
        """
        if self._closed:
            raise ClosedError(f"the thread pool of worker {self._name!r} is shut down")
        job = Job(fn, args)
        with self._lock:
            self._queued += 1
            if self._exhausted():
                self._queued -= 1
                self.refused += 1
                raise self._exhausted_error()
            start = self._should_start()
            if start:
                self._reserve_thread()
        self._jobs.put(job)
        handoffs.count("loop_to_pool")
        if start:
            try:
                self._start_thread()
            except RuntimeError as exc:  # "can't create new thread at interpreter shutdown"
                job.cancel()
                raise ClosedError(f"worker {self._name!r} cannot start a thread: {exc}") from exc
        return job

    def _reserve_thread(self) -> None:
        # Under the lock: count a thread about to start as alive and idle.
        self._threads += 1
        self._running += 1
        self._idle += 1

    def _exhausted_error(self) -> ThreadPoolExhaustedError:
        return ThreadPoolExhaustedError(self._name, self.max_threads)

    # -- blocking waits of pool threads (threads/blocking.py) ------------------------------

    def blocking_begin(self) -> None:
        """A pool thread starts waiting on an RPC future: start a stand-in if work waits."""
        with self._lock:
            self._blocked += 1
            start = not self._closed and self._should_start()
            if start:
                self._reserve_thread()
            exhausted = not start and self._exhausted()
        if start:
            # Interpreter exiting (RuntimeError): the waits end with the process.
            with contextlib.suppress(RuntimeError):
                self._start_thread()
        elif exhausted:
            self._refuse_queued()

    def blocking_end(self) -> None:
        """The wait is over; a surplus thread exits after its job (see ``_retire``)."""
        with self._lock:
            self._blocked -= 1

    def _refuse_queued(self) -> None:
        """Fail the jobs that wait for a thread that cannot come (bounded: queue length)."""
        error = self._exhausted_error()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # shutdown's sentinel: leave it for a thread
                self._jobs.put(None)
                return
            with self._lock:
                self._queued -= 1
                self.refused += 1
            if not job.cancelled and job.refused is not None:
                self.post(job.refused, error)

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop (from any thread); completions are batched."""
        # A closed loop: the agent is gone and nobody reads replies.
        with contextlib.suppress(RuntimeError):
            self._completions.put(callback, args)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on a pool thread and return (or raise) what it did.

        ``fn`` runs in a copy of the awaiting task's context variables, as with
        ``asyncio.to_thread``: what the task runs in (a distributed autograd context, the
        profiler's recording) goes with the work to the thread.
        """
        future = self._loop.create_future()
        context = contextvars.copy_context()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return  # the awaiting task was cancelled
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> None:
            try:
                value = context.run(fn, *args)
            except BaseException as exc:
                self.post(settle, False, exc)
                return
            self.post(settle, True, value)

        job = self.submit(work)
        job.dropped = functools.partial(
            settle, False, ClosedError(f"the thread pool of worker {self._name!r} shut down")
        )
        job.refused = functools.partial(settle, False)
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
        with self._lock:
            threads = self._threads
        for _ in range(threads):
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

    def _start_thread(self) -> None:
        """Start the thread reserved by ``_reserve_thread`` (released again on failure)."""
        thread = threading.Thread(
            target=self._work, name=f"asyncrpc-{self._name}-{self._threads}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self._threads -= 1
                self._running -= 1
                self._idle -= 1
            raise

    def _work(self) -> None:
        set_blocking_host(self)
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
                if self._retire():
                    return
                self._idle += 1

    def _retire(self) -> bool:
        # Under the lock, after a job: a stand-in whose blocked thread woke up leaves, unless
        # jobs wait for a thread.
        if self._threads - self._blocked > self.size and self._queued <= self._idle:
            self._threads -= 1
            return True
        return False
