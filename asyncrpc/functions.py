"""Decorators for functions run remotely: ``async_execution`` and ``inline`` (layer L0).

A function marked ``@async_execution`` returns a future (``asyncrpc.Future``,
``torch.futures.Future``, an asyncio future or a coroutine) and the callee replies when it
completes, without holding a pool thread meanwhile. Functions marked with torch's own
``torch.distributed.rpc.functions.async_execution`` are honoured too. A function marked
``@inline`` runs on the callee's event loop instead of its thread pool. ``not_scriptable``
makes TorchScript refuse a function of asyncrpc's API with a clear error.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from asyncrpc.errors import TorchScriptCallError

__all__ = [
    "async_execution",
    "inline",
    "is_async_execution",
    "is_coroutine_function",
    "is_inline",
    "not_scriptable",
    "per_callable_cache",
]

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "_asyncrpc_async_execution"
_TORCH_MARK = "_wrapped_async_rpc_function"
_INLINE_MARK = "_asyncrpc_inline"


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a future whose result is the reply.

    Works under ``@staticmethod`` and ``@classmethod`` (put ``async_execution`` innermost).
    The function object itself is returned, so it still pickles by reference.

    Args:
        fn: the function to mark.

    Returns:
        ``fn``, marked.
    """
    setattr(fn, _MARK, True)
    return fn


def is_async_execution(fn: Any) -> bool:
    """True when ``fn`` (or the function under a bound method) is marked ``async_execution``.

    Args:
        fn: any callable; torch's ``rpc.functions.async_execution`` mark counts too.

    Returns:
        Whether the callee replies with the outcome of the future ``fn`` returns.
    """
    return bool(getattr(fn, _MARK, False)) or getattr(fn, _TORCH_MARK, None) is not None


def inline(fn: F) -> F:
    """Run the synchronous ``fn`` on the callee's event loop, not on its thread pool.

    For functions that return in microseconds and never block (read a counter, index a
    dict, a small tensor op): the call skips two thread hand-offs, which is most of a small
    call's cost. While ``fn`` runs, the callee serves nothing else, so a function that
    sleeps, waits on a lock or makes a blocking RPC must not be marked (a blocking
    ``rpc_sync`` inside it raises ``BlockingCallError``). Combines with
    ``async_execution``; ``async def`` functions already run on the loop.

    Args:
        fn: the function to mark.

    Returns:
        ``fn``, marked (it still pickles by reference).
    """
    setattr(fn, _INLINE_MARK, True)
    return fn


def is_inline(fn: Any) -> bool:
    """True when ``fn`` (or the function under a bound method) is marked ``inline``.

    Args:
        fn: any callable.

    Returns:
        Whether the callee runs ``fn`` on its event loop.
    """
    return bool(getattr(fn, _INLINE_MARK, False))


def not_scriptable(fn: F) -> F:
    """Make ``torch.jit.script`` raise ``TorchScriptCallError`` where a scripted function
    calls ``fn`` (or ``fn`` itself is scripted), instead of failing on its annotations.

    TorchScript compiles each Python function a scripted one calls, and first calls its
    ``__prepare_scriptable__`` if it has one: that hook raises. Calls from Python are
    untouched.

    Args:
        fn: a function of asyncrpc's API.

    Returns:
        ``fn``, with the hook.
    """

    def refuse() -> NoReturn:
        raise TorchScriptCallError(f"asyncrpc.{fn.__name__}")

    setattr(fn, "__prepare_scriptable__", refuse)  # noqa: B010 (a dunder mypy would refuse)
    return fn


R = TypeVar("R")


def per_callable_cache(compute: Callable[[Any], R]) -> Callable[[Any], R]:
    """Memoise ``compute(fn)`` per callable (bounded): it runs on every call's hot path.

    Unhashable callables are computed every time.

    Args:
        compute: a pure function of one callable.

    Returns:
        ``compute`` with a cache of its last 4,096 callables (its name and docstring kept).
    """
    cached = functools.lru_cache(maxsize=4096)(compute)

    def lookup(fn: Any) -> R:
        try:
            return cached(fn)
        except TypeError:  # unhashable: nothing to cache
            return compute(fn)

    return functools.update_wrapper(lookup, compute)  # compute's name and docstring


@per_callable_cache
def is_coroutine_function(fn: Any) -> bool:
    """True when calling ``fn`` returns a coroutine (``async def``), cached per function.

    Args:
        fn: any callable; an object with an ``async def __call__`` counts.

    Returns:
        Whether the callee awaits ``fn(...)`` on its event loop.
    """
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - objects with an async __call__
    )
