"""asyncrpc's futures: the Future class (``core.py``) and ``collect_all``/``wait_all``,
torch's groups over many futures; and the package-private helpers the runtime and the
layers above use on a future. Import them from here (or ``asyncrpc.runtime.futures``).

Layer L2.02: the public home of the future names; the class, the callback executor
(``callbacks.py``) and the bridges to other futures (``bridge.py``) live below it. The
helpers are functions over the class, as CPython's ``asyncio.futures`` keeps
``_set_result_unless_cancelled`` and ``_get_loop``: code elsewhere never reaches into a
future's private fields.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from asyncrpc.runtime.futures.callbacks import set_default_callback_loop
from asyncrpc.runtime.futures.core import Future, FutureAlreadyDoneError, FutureNotDoneError

__all__ = [
    "Future",
    "FutureAlreadyDoneError",
    "FutureNotDoneError",
    "add_hook",
    "chain",
    "collect_all",
    "copy_outcome",
    "make_sibling",
    "on_cancel",
    "on_value",
    "set_default_callback_loop",  # for the agent, which imports it from here
    "try_set_exception",
    "try_set_result",
    "wait_all",
]

T = TypeVar("T")


# -- package-private helpers: the runtime's uses of a future, over its class -------------------


def try_set_result(future: Future[T], value: T) -> bool:
    """Complete ``future`` with ``value`` unless it is done already (a late reply after a
    cancel or a timeout is no error); whether this call completed it."""
    return future._try_set_result(value)


def try_set_exception(future: Future[Any], exc: BaseException) -> bool:
    """Complete ``future`` with ``exc`` unless it is done already; whether this call did."""
    return future._try_set_exception(exc)


def add_hook(future: Future[T], hook: Callable[[Future[T]], object]) -> None:
    """Run ``hook(future)`` in the thread that completes it (now, if done). A hook only
    hands off (schedules, completes another future); it never runs user code."""
    future._add_hook(hook)


def chain(future: Future[T], callback: Callable[[Future[T]], Any]) -> Future[Any]:
    """``future.then(callback)`` as the runtime chains: the callback runs on the future's
    callback loop whoever registers it (never on the registering thread)."""
    return future._then(callback)


def make_sibling(future: Future[Any]) -> Future[Any]:
    """A new pending future on ``future``'s callback loop (to complete from a hook)."""
    return Future(loop=future._loop)


def copy_outcome(target: Future[Any], source: Future[Any]) -> None:
    """Complete ``target`` with the outcome of ``source``, which is done (a hook)."""
    target._copy_from(source)


def on_cancel(future: Future[Any], hook: Callable[[], object]) -> None:
    """Call ``hook`` when ``future.cancel()`` cancels it (the outbox cancels the call)."""
    future._cancel_hook = hook


def on_value(future: Future[Any], reader: Callable[[], object]) -> None:
    """Call ``reader`` on each thread that reads the value, before it gets it (CUDA: its
    streams wait for the reply's copies). Set before ``future`` completes."""
    future._on_value = reader


# -- groups ------------------------------------------------------------------------------------


class _Countdown:
    """Completes ``result`` with ``futures`` once every one of them is done."""

    __slots__ = ("_futures", "_left", "_lock", "_result")

    def __init__(self, futures: list[Future[Any]], result: Future[list[Future[Any]]]) -> None:
        self._futures = futures
        self._result = result
        self._left = len(futures)
        self._lock = threading.Lock()

    def __call__(self, _: object) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try_set_result(self._result, self._futures)


def collect_all(futures: Sequence[Any]) -> Future[list[Future[Any]]]:
    """Return a future completed with the list of ``futures`` once all of them are done.

    Args:
        futures: asyncrpc or torch futures (anything ``Future.wrap`` takes).

    Returns:
        A future of the futures (as asyncrpc Futures, in order); it never fails itself:
        inspect each one.

    Cancellation: cancelling the result does not cancel the futures.
    """
    ours = [Future.wrap(f) for f in futures]
    result: Future[list[Future[Any]]] = Future()
    if not ours:
        result.set_result(ours)
        return result
    countdown = _Countdown(ours, result)
    for fut in ours:
        fut._add_hook(countdown)
    return result


def wait_all(futures: Sequence[Any]) -> list[Any]:
    """Block until all ``futures`` are done, or one fails; return their values in order.

    torch's rule for ``torch.futures.wait_all`` over its RPC futures: the first failure
    (in time) is raised at once, without waiting for the others. Use ``collect_all`` to
    wait for every future whatever happens.

    Args:
        futures: asyncrpc or torch futures (anything ``Future.wrap`` takes).

    Returns:
        The values of ``futures``, in their order.

    Raises:
        BlockingCallError: Some are not done and this is the agent's loop thread.
        BaseException: The stored exception of the first future to fail (of the first in
            list order among those failed already).

    Cancellation: a cancelled future counts as failed with ``asyncio.CancelledError``.
    """
    ours = [Future.wrap(f) for f in futures]
    failed = next((fut for fut in ours if fut.done() and fut.exception() is not None), None)
    pending = [fut for fut in ours if not fut.done()]
    if failed is None and pending:
        failed = _first_failure(pending)
    if failed is not None:
        failed.value()  # raises its exception
    return [fut.value() for fut in ours]


def _first_failure(pending: list[Future[Any]]) -> Future[Any] | None:
    """Block until every future of ``pending`` is done (None) or one fails (that one)."""
    outcome: Future[Future[Any] | None] = Future()
    watch = _FirstFailure(len(pending), outcome)
    for fut in pending:
        fut._add_hook(watch)
    try:
        outcome._block(None)
    finally:
        for fut in pending:  # those still running keep no reference to this wait
            fut._discard_hook(watch)
    return outcome.value()


class _FirstFailure:
    """Completes ``outcome`` with the first future that fails, or None once all are done."""

    __slots__ = ("_left", "_lock", "_outcome")

    def __init__(self, count: int, outcome: Future[Future[Any] | None]) -> None:
        self._left = count
        self._outcome = outcome
        self._lock = threading.Lock()

    def __call__(self, fut: Future[Any]) -> None:
        if fut.exception() is not None:  # a hook runs once `fut` is done
            self._outcome._try_set_result(fut)
            return
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._outcome._try_set_result(None)
