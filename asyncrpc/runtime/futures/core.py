"""asyncrpc's Future class: torch's JitFuture contract (completion, ``wait``, ``value``,
``add_done_callback``, ``then``) on a ``torch.futures.Future`` that is also awaitable.

Layer L2. Where callbacks run is ``callbacks.py``; conversions to and from other futures are
``futurebridge.py``; import the public names from ``future.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import types
from collections.abc import Awaitable, Callable, Generator, Sequence
from functools import partial
from typing import Any, TypeAlias, TypeVar, cast, overload

import torch
import torch.futures

from asyncrpc.errors import AsyncRpcError, as_callback_error
from asyncrpc.runtime.futures.bridge import (
    CFuture,
    complete_torch_side,
    copy_from_torch,
    copy_to_torch,
    link_asyncio,
    link_concurrent,
    run_awaitable,
    wake_waiter,
)
from asyncrpc.runtime.futures.callbacks import (
    MayBlock,
    caller_may_block,
    check_not_blocking_loop,
    default_loop,
    running_loop,
    submit,
)
from asyncrpc.runtime.threads import handoffs
from asyncrpc.runtime.threads.blocking import blocking

__all__ = [
    "Future",
    "FutureAlreadyDoneError",
    "FutureNotDoneError",
]

T = TypeVar("T")
S = TypeVar("S")

# The logger keeps the name users configure: this class was asyncrpc.runtime.futures's.
logger = logging.getLogger(__name__)

# An internal completion hook: a callable run in the completing thread, or an awaiter's
# asyncio future, set on its own loop.
_Hook: TypeAlias = "Callable[[Future[T]], object] | asyncio.Future[None]"

_PENDING = 0
_RESULT = 1
_EXCEPTION = 2

_c_init = CFuture.__init__
_NO_DEVICES: list[torch.device] = []


class FutureNotDoneError(AsyncRpcError, RuntimeError):
    """``value()`` or ``exception()`` was called on a future that is not done yet."""


class FutureAlreadyDoneError(AsyncRpcError, RuntimeError):
    """``set_result``/``set_exception`` on a future that was already completed (or cancelled)."""


class Future(torch.futures.Future[T]):
    """The result of an asynchronous operation: a ``torch.futures.Future`` you can also await.

    Completed once, from any thread, by ``set_result``/``set_exception``. Wait for it with
    ``wait()`` from a plain thread, ``await`` it from any asyncio loop of the process, or chain
    work with ``then``/``add_done_callback``. It is a ``torch.futures.Future`` too:
    ``torch.futures.wait_all`` and ``collect_all`` take it.

    Callbacks never run inside the completing call's critical section. Those registered from
    a thread running an event loop (async code, the agent) run in registration order on the
    callback loop (``loop=`` or the registered agent loop), where they must not block; with
    no loop, in the completing thread right after completion. Those registered from
    synchronous code (no running loop in the thread) while the agent runs go to a thread pool
    instead, where they may block on other futures, as torch's callbacks may; among
    themselves they keep registration order. A future made with another ``loop=`` than
    the agent's runs every callback on that loop.
    """

    # _value holds the result or the exception (the state says which); _tb is the traceback the
    # exception had when stored, re-attached on every raise so tracebacks never grow.
    # _callbacks: None = no callback pending; a list = callbacks waiting for (or in) a drain.
    # _hooks: internal one-shot hooks run in the completing thread (awaiter wake-ups, chaining);
    # they only hand off (call_soon_threadsafe, set a future) and never run user code.
    __slots__ = (
        "_callbacks",
        "_cancel_hook",
        "_gate",
        "_hooks",
        "_lock",
        "_loop",
        "_on_value",
        "_state",
        "_tb",
        "_value",
    )

    def __init__(self, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Create a pending future whose callbacks run on ``loop``.

        With ``loop=None`` they run on the agent loop registered with
        ``set_default_callback_loop`` while it runs, else in the completing thread.

        Args:
            loop: the event loop that runs this future's callbacks (see the class).
        """
        _c_init(self, _NO_DEVICES)
        self._state = _PENDING
        self._value: Any = None
        self._tb: types.TracebackType | None = None
        self._callbacks: list[Callable[[Future[T]], object]] | None = None
        self._hooks: list[_Hook[T]] | None = None
        # Held (locked) while pending once a thread blocks on it; released on completion.
        self._gate: threading.Lock | None = None
        self._loop = loop
        self._lock = threading.Lock()
        # Set by the agent to cancel the remote call when this future is cancelled.
        self._cancel_hook: Callable[[], object] | None = None
        # Set by the agent before completing it: called on each thread that reads the
        # result, first (CUDA: its current streams wait for the reply's copies).
        self._on_value: Callable[[], object] | None = None

    def __repr__(self) -> str:
        state = ("pending", "result", "exception")[self._state]
        return f"<asyncrpc.Future {state} at {id(self):#x}>"

    # -- inspection ----------------------------------------------------------------------------

    def done(self) -> bool:
        """Return True once the future holds a result or an exception (cancelled included)."""
        return self._state != _PENDING

    def value(self) -> T:
        """Return the result without waiting (torch ``Future.value``).

        Returns:
            The result the future was completed with.

        Raises:
            FutureNotDoneError: The future is not done yet.
            BaseException: The stored exception (``asyncio.CancelledError`` if cancelled).
        """
        state = self._state
        if state == _RESULT:
            if self._on_value is not None:
                self._on_value()
            return cast(T, self._value)
        if state == _EXCEPTION:
            raise self._value.with_traceback(self._tb)
        raise FutureNotDoneError("value() called on a future that is not done; wait() for it")

    def exception(self) -> BaseException | None:
        """Return the stored exception, or None if the future holds a result.

        Raises:
            FutureNotDoneError: The future is not done yet.

        Cancellation: a cancelled future returns its ``asyncio.CancelledError``.
        """
        state = self._state
        if state == _PENDING:
            raise FutureNotDoneError("exception() called on a future that is not done")
        return cast(BaseException, self._value) if state == _EXCEPTION else None

    # -- blocking wait -------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> T:
        """Block the calling thread until done and return the result.

        Args:
            timeout: Seconds to wait at most; None waits forever.

        Returns:
            The result.

        Raises:
            BlockingCallError: Not done and called on the agent's loop thread.
            TimeoutError: Not done within ``timeout`` (the future stays pending).
            BaseException: The stored exception (``asyncio.CancelledError`` if cancelled).
        """
        if self._state == _PENDING and not self._block(timeout):
            raise TimeoutError(f"future not done after {timeout:g} s")
        return self.value()

    def result(self, timeout: float | None = None) -> T:
        """Alias of ``wait()`` for concurrent.futures-style code (same arguments and errors).

        Args:
            timeout: seconds to wait at most; None waits forever.

        Returns:
            The result.
        """
        return self.wait(timeout)

    def _block(self, timeout: float | None) -> bool:
        # The gate is made only when somebody really blocks: most futures are awaited. A
        # bare lock is the cheapest thing a thread can sleep on (an Event is a Condition,
        # which allocates a lock per wait and takes two more).
        check_not_blocking_loop()
        with self._lock:
            if self._state != _PENDING:
                return True
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()
        acquired = False
        try:
            # A pool thread that blocks here lets its pool start a stand-in (no deadlock).
            with blocking():
                acquired = gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        finally:
            if acquired:  # even if interrupted right after: never keep the gate
                gate.release()  # pass it on: other threads may wait on the same future
        return acquired

    # -- completion ----------------------------------------------------------------------------

    def set_result(self, result: T) -> None:
        """Complete the future with ``result`` and schedule its callbacks.

        Args:
            result: the value waiters and callbacks get.

        Raises:
            FutureAlreadyDoneError: The future was already completed or cancelled.
        """
        if not self._complete(_RESULT, result, None):
            raise FutureAlreadyDoneError("a Future can only be marked completed once")

    # torch annotates the argument as T; it takes an exception, as ours does.
    def set_exception(self, exc: BaseException) -> None:  # type: ignore[override]
        """Complete the future with the exception instance ``exc``; waiters raise it.

        Args:
            exc: an exception instance.

        Raises:
            TypeError: ``exc`` is not an exception instance.
            FutureAlreadyDoneError: The future was already completed or cancelled.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"set_exception() needs an exception instance, got {exc!r}")
        if not self._complete(_EXCEPTION, exc, exc.__traceback__):
            raise FutureAlreadyDoneError("a Future can only be marked completed once")

    def cancel(self) -> bool:
        """Cancel: complete with ``asyncio.CancelledError`` and run the agent's cancel hook.

        Returns:
            True if this call cancelled the future, False if it was already done.

        Cancellation: waiters and awaiters get ``asyncio.CancelledError``; the hook (set by
        the agent) asks the callee to drop the call. Exceptions from the hook are logged.
        """
        if not self._complete(_EXCEPTION, asyncio.CancelledError(), None):
            return False
        hook = self._cancel_hook
        if hook is not None:
            self._cancel_hook = None
            try:
                hook()
            except Exception:
                logger.exception("cancel hook %r of %r failed", hook, self)
        return True

    def _try_set_result(self, result: T) -> bool:
        """Complete with ``result`` unless done already (for the agent: a late reply after a
        cancel or a timeout is not an error). Returns True if this call completed it."""
        return self._complete(_RESULT, result, None)

    def _try_set_exception(self, exc: BaseException) -> bool:
        """Complete with ``exc`` unless done already. Returns True if this call completed it."""
        return self._complete(_EXCEPTION, exc, exc.__traceback__)

    def _complete(self, state: int, value: object, tb: types.TracebackType | None) -> bool:
        # Invariant: the state changes under the lock; everything that may run code or wake
        # threads (event, hooks, callbacks) happens after the lock is released.
        with self._lock:
            if self._state != _PENDING:
                return False
            # The value before the state: lock-free readers (done, value, the await fast
            # path) test the state first, then read the value.
            self._value = value
            self._tb = tb
            self._state = state
            hooks = self._hooks
            self._hooks = None
            gate = self._gate
            drain = self._callbacks is not None
        # The C side first: see complete_torch_side.
        complete_torch_side(self, state == _EXCEPTION, value)
        if gate is not None:
            handoffs.count("to_waiting_thread")
            gate.release()
        if hooks is not None:
            self._run_hooks(hooks)
        if drain:
            self._schedule_drain()
        return True

    def _run_hooks(self, hooks: list[_Hook[T]]) -> None:
        # An asyncio future in the list is an awaiter's waiter (no partial per await).
        for hook in hooks:
            if isinstance(hook, asyncio.Future):
                wake_waiter(hook)
                continue
            try:
                hook(self)
            except Exception:  # hooks are ours and should not raise; never lose the others
                logger.exception("internal completion hook %r of %r failed", hook, self)

    # -- callbacks -----------------------------------------------------------------------------

    def add_done_callback(self, callback: Callable[[Future[T]], object]) -> None:
        """Call ``callback(self)`` once done, after the callbacks registered before it.

        It runs on the callback loop (scheduled, also when the future is already done) or,
        with no loop, in the completing thread (here, if already done). Its exceptions are
        logged on ``asyncrpc.runtime.futures`` and swallowed.

        Args:
            callback: Called with this future.

        Cancellation: a cancelled future is done, so the callback runs and sees
        ``asyncio.CancelledError`` from ``value()``.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        _check_callable(callback)
        self._add_callback(MayBlock(callback) if caller_may_block(self._loop) else callback)

    def _add_callback(self, callback: Callable[[Future[T]], object]) -> None:
        # Internal: add a callback that runs on the callback loop whoever registers it.
        with self._lock:
            callbacks = self._callbacks
            if callbacks is not None:
                callbacks.append(callback)
                return
            self._callbacks = [callback]
            if self._state == _PENDING:
                return
        self._schedule_drain()

    def _add_hook(self, hook: Callable[[Future[T]], object]) -> None:
        # Internal: run `hook(self)` in the completing thread (or now, if done).
        with self._lock:
            if self._state == _PENDING:
                if self._hooks is None:
                    self._hooks = [hook]
                else:
                    self._hooks.append(hook)
                return
        self._run_hooks([hook])

    def _discard_hook(self, hook: _Hook[T]) -> None:
        with self._lock:
            hooks = self._hooks
            if hooks is not None and hook in hooks:
                hooks.remove(hook)

    def _schedule_drain(self) -> None:
        loop = self._loop
        if loop is None:
            loop = default_loop()
            if loop is None or not loop.is_running():
                self._run_callbacks()
                return
        if running_loop() is loop:
            loop.call_soon(self._run_callbacks)
            return
        handoffs.count("to_callback_loop")
        try:
            loop.call_soon_threadsafe(self._run_callbacks)
        except RuntimeError:  # the loop is closed: run them here rather than lose them
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        # Drains in batches: callbacks added while a batch runs (from a callback or another
        # thread) join the list and run in the next batch, so order is registration order.
        # On a loop, a run of callbacks that may block goes to the pool as one job.
        while True:
            with self._lock:
                callbacks = self._callbacks
                if not callbacks:
                    self._callbacks = None
                    return
                self._callbacks = []
            on_loop = running_loop() is not None
            blocking: list[Callable[[Future[T]], object]] = []
            for callback in callbacks:
                if type(callback) is MayBlock and on_loop:
                    blocking.append(callback.callback)
                    continue
                if blocking:
                    submit(self._invoke, blocking)
                    blocking = []
                self._invoke((callback,))
            if blocking:
                submit(self._invoke, blocking)

    def _invoke(self, callbacks: Sequence[Callable[[Future[T]], object]]) -> None:
        for callback in callbacks:
            try:
                callback(self)
            except (SystemExit, KeyboardInterrupt):
                # The process is going down: drop the rest but leave a state in which
                # later callbacks still get a drain of their own.
                with self._lock:
                    self._callbacks = None
                raise
            except BaseException:
                logger.exception("callback %r of %r raised", callback, self)

    @overload
    def then(self, callback: Callable[[Future[T]], Awaitable[S]]) -> Future[S]: ...
    @overload
    def then(self, callback: Callable[[Future[T]], torch.futures.Future[S]]) -> Future[S]: ...
    @overload
    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]: ...
    def then(self, callback: Callable[[Future[T]], Any]) -> Future[Any]:
        """Return a future of ``callback(self)``, run like any done callback.

        If the callback raises, the new future holds that exception, made a ``RuntimeError``
        too as torch reports it (``errors.as_callback_error``: still an instance of its own
        type, the original as its cause). If it returns a future
        (ours, ``torch.futures.Future``, asyncio or concurrent.futures) or a coroutine, the new
        future completes with that one's outcome: never a future of a future.

        Args:
            callback: Called with this future once it is done.

        Returns:
            A future on the same callback loop.

        Raises:
            TypeError: ``callback`` is not callable.

        Cancellation: cancelling the returned future does not cancel this one.
        """
        _check_callable(callback)
        child: Future[Any] = Future(loop=self._loop)
        job = partial(_run_then, callback, child, as_callback_error)
        self._add_callback(MayBlock(job) if caller_may_block(self._loop) else job)
        return child

    def _then(self, callback: Callable[[Future[T]], Any]) -> Future[Any]:
        # Internal `then`: the callback runs on the callback loop whoever registers it.
        child: Future[Any] = Future(loop=self._loop)
        self._add_callback(partial(_run_then, callback, child, None))
        return child

    def _copy_from(self, source: Future[Any]) -> None:
        # Hook: complete self with a done `source`'s outcome (a no-op if self is done).
        if source._state == _RESULT:
            if source._on_value is not None and self._state == _PENDING:
                self._on_value = source._on_value
            self._complete(_RESULT, source._value, None)
        else:
            self._complete(_EXCEPTION, source._value, source._tb)

    # -- await ---------------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        """Wait on the running loop (any loop of the process) and return the result.

        Cancellation: cancelling the awaiting task only stops this wait; the future is shared,
        stays pending and can be awaited again.
        """
        if self._state == _PENDING:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            with self._lock:
                pending = self._state == _PENDING
                if pending:
                    if self._hooks is None:
                        self._hooks = [waiter]
                    else:
                        self._hooks.append(waiter)
            if pending:
                try:
                    yield from waiter
                except BaseException:
                    self._discard_hook(waiter)  # cancelled awaiters leave no hook behind
                    raise
        return self.value()

    # -- bridges -------------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, fut: torch._C.Future[S]) -> Future[S]:
        """Return a new future completed with the outcome of the torch future ``fut`` (a
        ``torch.futures.Future``, or the bare ``torch._C.Future`` its ``then`` returns).

        Args:
            fut: a torch future (from torch's own RPC, ``torch.jit.fork``, ...).

        Returns:
            An asyncrpc ``Future`` that completes when ``fut`` does.

        Cancellation: torch futures cannot be cancelled; cancelling the result leaves
        ``fut`` running.
        """
        ours: Future[Any] = cls()
        fut.add_done_callback(partial(copy_from_torch, ours))
        return ours

    def to_torch(self) -> torch.futures.Future[T]:
        """Return a new ``torch.futures.Future`` completed (from a callback) with our outcome.

        Cancellation: a cancelled future completes the torch one with a ``RuntimeError``
        (torch only stores ``Exception``s), its cause the ``CancelledError``.
        """
        tfut: torch.futures.Future[T] = torch.futures.Future()
        self._add_callback(partial(copy_to_torch, tfut))
        return tfut

    @classmethod
    def wrap(cls, obj: object, *, loop: asyncio.AbstractEventLoop | None = None) -> Future[Any]:
        """Return ``obj`` as an asyncrpc Future.

        Args:
            obj: A ``Future`` (returned as is), a ``torch.futures.Future``, an
                ``asyncio.Future``, a ``concurrent.futures.Future``, or a coroutine/awaitable.
            loop: For a coroutine, the loop that runs it (default: the running loop of this
                thread, else the registered agent loop); also the result's callback loop.

        Raises:
            TypeError: ``obj`` is none of the above.
            NotInitializedError: A coroutine, but there is no loop to run it on.

        Cancellation: cancelling the result cancels the wrapped asyncio or concurrent future
        or the task running the coroutine.
        """
        if isinstance(obj, Future):
            return obj
        if isinstance(obj, asyncio.Future):
            return _from_asyncio(obj, loop)
        if isinstance(obj, concurrent.futures.Future):
            return _from_concurrent(obj, loop)
        if isinstance(obj, CFuture):
            return cls.from_torch(cast(Any, obj))
        if isinstance(obj, Awaitable):
            started, loop = run_awaitable(obj, loop)
            if isinstance(started, asyncio.Future):
                return _from_asyncio(started, None)
            return _from_concurrent(started, loop)
        raise TypeError(f"cannot wrap {type(obj).__qualname__} as an asyncrpc Future")


# -- helpers (module level: partials over them are cheaper than closures) ----------------------


def _check_callable(callback: object) -> None:
    if not callable(callback):
        raise TypeError(
            f"a Future callback must be callable, got {type(callback).__name__} "
            "(incompatible function arguments.)"
        )


def _run_then(
    callback: Callable[[Future[Any]], object],
    child: Future[Any],
    convert: Callable[[BaseException], BaseException] | None,
    parent: Future[Any],
) -> None:
    try:
        outcome = callback(parent)
    except BaseException as exc:
        child._try_set_exception(exc if convert is None else convert(exc))
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            raise
        return
    _settle(child, outcome)


def _settle(child: Future[Any], outcome: object) -> None:
    # Flatten: a future-like outcome completes `child` with its own outcome.
    if isinstance(outcome, _FLATTEN_TYPES):
        try:
            source = Future.wrap(outcome, loop=child._loop)
        except BaseException as exc:
            child._try_set_exception(exc)
            return
        if source is child:
            child._try_set_exception(RuntimeError("a then() callback returned its own future"))
            return
        source._add_hook(child._copy_from)
        return
    if isinstance(outcome, CFuture):
        cast(Any, outcome).add_done_callback(partial(copy_from_torch, child))
        return
    child._try_set_result(outcome)


_FLATTEN_TYPES = (Future, asyncio.Future, concurrent.futures.Future, types.CoroutineType)


def _from_asyncio(afut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop | None) -> Future[Any]:
    ours: Future[Any] = Future(loop=loop if loop is not None else afut.get_loop())
    link_asyncio(afut, ours)
    return ours


def _from_concurrent(
    cfut: concurrent.futures.Future[Any], loop: asyncio.AbstractEventLoop | None
) -> Future[Any]:
    ours: Future[Any] = Future(loop=loop)
    link_concurrent(cfut, ours)
    return ours
