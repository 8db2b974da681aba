"""Bridges between asyncrpc's Future and the other futures: torch's C future, asyncio
futures and tasks, ``concurrent.futures`` and coroutines, completed from any thread.

Layer L2, below ``future.py``: the functions here fill a future through the narrow
``Settable`` surface, so they never import the Future class (asyncio's ``_chain_future``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import types
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import torch

from asyncrpc.errors import NotInitializedError
from asyncrpc.runtime.futures.callbacks import default_loop, running_loop
from asyncrpc.runtime.threads import handoffs

__all__ = [
    "CFuture",
    "Settable",
    "complete_torch_side",
    "copy_from_torch",
    "copy_to_torch",
    "link_asyncio",
    "link_concurrent",
    "run_awaitable",
    "wake_waiter",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

# torch's future, reached through its C base: torch.futures.wait_all/collect_all read the C
# future's own state, so every completion of ours completes it too (complete_torch_side).
CFuture = torch._C.Future
_c_set_result = CFuture.set_result
_c_set_unwrap = CFuture._set_unwrap_func


class Settable(Protocol):
    """What a bridge needs of the future it fills: the Future's internal completion surface.

    ``_try_set_*`` complete the future unless it is done already (True if this call did);
    ``_cancel_hook`` is called once when the future is cancelled (cancel the source).
    """

    _cancel_hook: Callable[[], object] | None

    def _try_set_result(self, result: Any) -> bool: ...

    def _try_set_exception(self, exc: BaseException) -> bool: ...


class Outcome(Protocol):
    """A done future's outcome, read the torch way."""

    def value(self) -> Any: ...

    def exception(self) -> BaseException | None: ...


# -- torch ---------------------------------------------------------------------------------


def complete_torch_side(fut: Any, failed: bool, value: object) -> None:
    """Complete the C future under ``fut`` (one of ours) with its outcome ``value``."""
    # `fut` is Any: it is an Outcome and a torch C future at once, which no type spells.
    # Complete the C future before waking anyone: whoever sees ours done may hand it to
    # torch.futures.wait_all, which waits on the C side. torch stores an exception as the
    # value plus an unwrap function that raises it (as torch.futures.Future does). Ours
    # stores a weak reference to this future instead of the exception: what C++ holds
    # is invisible to the garbage collector, and an exception's traceback often leads
    # back here (frames holding this future, or RRefs), a cycle never collected.
    try:
        if failed:
            _c_set_unwrap(fut, _raise_stored)
            value = weakref.ref(fut)
        _c_set_result(fut, value)
    except Exception:  # only if somebody completed the C side behind our back
        logger.exception("could not complete the torch side of %r", fut)


def _raise_stored(ref: weakref.ref[Outcome]) -> None:
    # torch's unwrap function for a future holding an exception: waiting on it raises it.
    fut = ref()
    if fut is None:  # only C++ holds the future now: nobody waits on it in Python
        raise RuntimeError("the asyncrpc future that failed was garbage-collected")
    fut.value()


def copy_from_torch(ours: Settable, tfut: Any) -> None:
    """Complete ``ours`` with the outcome of the done torch future ``tfut``."""
    # Runs in the thread that completes the torch future (or now, if it is done).
    try:
        value = tfut.value()
    except BaseException as exc:
        ours._try_set_exception(exc)
    else:
        ours._try_set_result(value)


def copy_to_torch(tfut: Any, ours: Outcome) -> None:
    """Complete the torch future ``tfut`` with the outcome of the done ``ours``."""
    exc = ours.exception()
    if exc is None:
        tfut.set_result(ours.value())
        return
    if not isinstance(exc, Exception):  # torch asserts on BaseException (CancelledError)
        wrapped = RuntimeError(f"the asyncrpc future failed with {type(exc).__name__}")
        wrapped.__cause__ = exc
        exc = wrapped
    tfut.set_exception(exc)


# -- asyncio and concurrent.futures --------------------------------------------------------


def wake_waiter(waiter: asyncio.Future[None]) -> None:
    """Set an awaiter's asyncio future on its own loop, from the completing thread."""
    loop = waiter.get_loop()
    if running_loop() is loop:
        _set_waiter(waiter)
        return
    handoffs.count("to_awaiting_loop")
    # try/except, not contextlib.suppress: this runs per cross-thread wake-up.
    try:  # noqa: SIM105
        loop.call_soon_threadsafe(_set_waiter, waiter)
    except RuntimeError:  # the awaiter's loop is closed: nobody is left to wake
        pass


def _set_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a cancelled awaiter just goes away
        waiter.set_result(None)


def link_asyncio(afut: asyncio.Future[Any], ours: Settable) -> None:
    """Complete ``ours`` with ``afut``'s outcome; cancelling ``ours`` cancels ``afut``."""
    aloop = afut.get_loop()
    copy = partial(_copy_from_foreign, ours)
    if running_loop() is aloop:
        afut.add_done_callback(copy)
        ours._cancel_hook = afut.cancel
        return
    if afut.done():  # a done asyncio future is immutable: safe to read from any thread
        copy(afut)
        return
    # asyncio futures are not thread-safe: touch them only from their loop's thread.
    aloop.call_soon_threadsafe(afut.add_done_callback, copy)
    ours._cancel_hook = partial(aloop.call_soon_threadsafe, afut.cancel)


def link_concurrent(cfut: concurrent.futures.Future[Any], ours: Settable) -> None:
    """Complete ``ours`` with ``cfut``'s outcome; cancelling ``ours`` cancels ``cfut``."""
    ours._cancel_hook = cfut.cancel
    cfut.add_done_callback(partial(_copy_from_foreign, ours))


def _copy_from_foreign(ours: Settable, other: Any) -> None:
    # For a done asyncio or concurrent.futures future (they share this API).
    if other.cancelled():
        ours._try_set_exception(asyncio.CancelledError())
        return
    exc = other.exception()
    if exc is not None:
        ours._try_set_exception(exc)
    else:
        ours._try_set_result(other.result())


def run_awaitable(
    obj: Awaitable[Any], loop: asyncio.AbstractEventLoop | None
) -> tuple[asyncio.Future[Any] | concurrent.futures.Future[Any], asyncio.AbstractEventLoop]:
    """Start ``obj`` on ``loop`` (default: the running loop, else the agent's).

    Returns:
        The task (on the running loop) or the concurrent future (on another loop) that
        holds the outcome, and the loop it runs on.

    Raises:
        NotInitializedError: There is no loop to run it on.

    Cancellation: cancelling the returned future cancels the coroutine.
    """
    coro = obj if isinstance(obj, types.CoroutineType) else _await(obj)
    running = running_loop()
    if loop is None:
        loop = running if running is not None else default_loop()
    if loop is None or loop.is_closed() or (loop is not running and not loop.is_running()):
        coro.close()  # never leave a "coroutine was never awaited" warning behind
        raise NotInitializedError(
            "no event loop to run the coroutine on: pass loop=, call from a running loop, "
            "or start the agent (init_rpc) first"
        )
    if loop is running:
        return loop.create_task(coro), loop
    return asyncio.run_coroutine_threadsafe(coro, loop), loop


async def _await(obj: Awaitable[T]) -> T:
    return await obj
