"""Where Future callbacks run: the agent's loop registration and the callback pool.

Layer L2: imports asyncio and threading. Callbacks registered from synchronous code while
the agent runs may block, so they go to a thread pool rather than the agent's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Callable
from typing import Any

from asyncrpc.errors import BlockingCallError
from asyncrpc.runtime.futures.callbackpool import CallbackPool

__all__ = [
    "CALLBACK_POOL_SIZE",
    "CALLBACK_THREAD_NAME",
    "MayBlock",
    "caller_may_block",
    "check_not_blocking_loop",
    "default_loop",
    "running_loop",
    "set_default_callback_loop",
    "submit",
]

# `asyncio._get_running_loop` is the documented low-level accessor (no exception when there is
# no loop). It is a C-level cached thread-local read: as cheap as comparing a cached thread id
# and right for every loop, including loops whose thread we never saw.
running_loop = asyncio._get_running_loop

# The agent's loop and its thread (set_default_callback_loop). Read without a lock: each is
# one reference, replaced whole; a reader that sees a stale loop finds it not running.
_default_loop: asyncio.AbstractEventLoop | None = None
_default_thread: int | None = None

# Callbacks registered from synchronous code may block (torch runs callbacks on its RPC
# threads, where waiting on another future is allowed). They run on this pool, made on first
# use; its threads are started as jobs arrive, up to the size.
CALLBACK_POOL_SIZE = 16
CALLBACK_THREAD_NAME = "asyncrpc-callback"  # its threads are named "asyncrpc-callback-N"
_pool: CallbackPool | None = None
_pool_lock = threading.Lock()


def set_default_callback_loop(
    loop: asyncio.AbstractEventLoop | None, thread_id: int | None = None
) -> None:
    """Register the agent's loop: futures built without ``loop=`` schedule callbacks there.

    Args:
        loop: The agent's event loop, or None to clear the registration (agent stop).
        thread_id: ``threading.get_ident()`` of the thread running ``loop``; blocking calls
            from that thread raise ``BlockingCallError``. Taken from the calling thread when
            None and ``loop`` is running there.

    Cancellation: not applicable; this only changes where later callbacks run.
    """
    global _default_loop, _default_thread
    if loop is not None and thread_id is None and running_loop() is loop:
        thread_id = threading.get_ident()
    _default_thread = thread_id if loop is not None else None
    _default_loop = loop


def default_loop() -> asyncio.AbstractEventLoop | None:
    """Return the loop registered by ``set_default_callback_loop``, or None."""
    return _default_loop


def check_not_blocking_loop() -> None:
    """Raise if the calling thread runs the agent's loop (blocking it would deadlock).

    Raises:
        BlockingCallError: The caller is the thread registered by ``set_default_callback_loop``.

    Cancellation: not applicable; nothing waits here.
    """
    tid = _default_thread
    if tid is not None and tid == threading.get_ident():
        raise BlockingCallError(
            "a blocking call (Future.wait, wait_all, rpc_sync...) was made on the agent's event "
            "loop thread; it would deadlock: await the future instead (a then() callback "
            "registered from async code runs on this loop; one registered from synchronous "
            "code runs on a thread pool, where it may block)"
        )


class MayBlock:
    """A callback registered from synchronous code: on a loop, it is sent to the pool."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[Any], object]) -> None:
        self.callback = callback

    def __call__(self, fut: Any) -> object:
        return self.callback(fut)

    def __repr__(self) -> str:
        return f"<may block: {self.callback!r}>"


def caller_may_block(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether a callback registered now, for a future bound to ``loop``, may block."""
    # The rule for callbacks: registered where no event loop runs (plain synchronous code,
    # a pool thread) while the agent runs, a callback may block, so it does not run on the
    # agent loop. Callbacks of futures bound to another loop always run on that loop.
    default = _default_loop
    return default is not None and (loop is None or loop is default) and running_loop() is None


def _callback_pool() -> CallbackPool:
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            pool = _pool
            if pool is None:
                pool = _pool = CallbackPool(CALLBACK_POOL_SIZE, CALLBACK_THREAD_NAME)
                atexit.register(pool.run_left_over)
    return pool


def _forget_pool() -> None:
    # A forked child has none of the parent's threads: it makes its own pool on first use.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def submit(invoke: Callable[[Any], None], callbacks: list[Any]) -> None:
    """Run ``invoke(callbacks)`` on the callback pool (here, if the interpreter is exiting).

    Jobs submitted in one loop turn wake at most one pool thread (see callbackpool.py).
    """
    try:
        _callback_pool().submit(invoke, callbacks)
    except RuntimeError:  # the interpreter is exiting: run them here rather than lose them
        invoke(callbacks)
