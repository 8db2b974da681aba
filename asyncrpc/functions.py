"""Decorators for functions run remotely: ``async_execution`` (layer L2).

A function marked ``@async_execution`` returns a future (``asyncrpc.Future``,
``torch.futures.Future``, an asyncio future or a coroutine) and the callee replies when it
completes, without holding a pool thread meanwhile. Functions marked with torch's own
``torch.distributed.rpc.functions.async_execution`` are honoured too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution", "is_async_execution", "is_coroutine_function"]

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "_asyncrpc_async_execution"
_TORCH_MARK = "_wrapped_async_rpc_function"


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
    """True when ``fn`` (or the function under a bound method) is marked ``async_execution``."""
    return bool(getattr(fn, _MARK, False)) or getattr(fn, _TORCH_MARK, None) is not None


_coroutine_cache: dict[Any, bool] = {}


def is_coroutine_function(fn: Any) -> bool:
    """True when calling ``fn`` returns a coroutine (``async def``), cached per function."""
    try:
        return _coroutine_cache[fn]
    except (KeyError, TypeError):
        pass
    result = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - objects with an async __call__
    )
    try:
        if len(_coroutine_cache) < 4096:
            _coroutine_cache[fn] = result
    except TypeError:
        pass
    return result
