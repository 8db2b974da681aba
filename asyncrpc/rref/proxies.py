"""The proxies of an RRef (layer L3): ``rref.rpc_sync().method(*args)`` and its kin run a
method of the RRef's value on its owner, as a call, a ``remote()``, a stream or a
bidirectional stream; the functions the owner runs for them live here too.

``handle.py`` makes the proxies; they see the RRef only through ``Proxied``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from asyncrpc.duplex import open_bidi
from asyncrpc.functions import is_async_execution, is_coroutine_function, is_inline
from asyncrpc.rref.values import owner_lost_as_rref_error, owner_value
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.calls.served import await_async_result
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.futures import Future, chain

__all__ = ["Proxied", "Proxy", "ProxyCalls"]


class ProxyCalls(Protocol):
    """The calls a proxy makes, of the current worker's RRef operations (``context.RRefs``;
    ``handle.RRefOps`` is the whole of them)."""

    def remote(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None = ...,
    ) -> Any: ...  # fmt: skip

    def call(
        self, to: int, fn: Any, args: Sequence[Any], timeout: float, kind: CallKind, target: str
    ) -> Future[Any]: ...


class _ProxiedBackend(Protocol):
    """What a proxy and the owner's side ask of an RRef's fork bookkeeping
    (``handle.RRefBackend``)."""

    def check_usable(self, rref: Any) -> None: ...

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any: ...


class Proxied(Protocol):
    """What a proxy, and the owner's side of a proxied call, ask of an RRef
    (``handle.RRef``): its owner, its value there, its bookkeeping."""

    @property
    def _ctx(self) -> _ProxiedBackend: ...

    @property
    def _owner(self) -> int: ...

    @property
    def _value(self) -> Future[Any] | None: ...

    def owner_name(self) -> str: ...

    def _get_type(self, timeout: float = ..., blocking: bool = ...) -> Any: ...


# Slots of this module's own view of the features (as duplex.py and streaming.py declare
# theirs): the RRef operations, the streams.
_RREFS: FeatureSlot[ProxyCalls] = FeatureSlot("rrefs", "RRefs")
_STREAMS: FeatureSlot[StreamHub] = FeatureSlot("streams", "streams")


class Proxy:
    """Turns ``proxy.method(*args, **kwargs)`` into a call of ``method`` on the owner, of
    the proxy's kind (a stream's items come from the iterator the method returns)."""

    __slots__ = ("_bidi", "_kind", "_rref", "_timeout", "_windows")

    def __init__(
        self, rref: Proxied, kind: CallKind, timeout: float,
        windows: tuple[int | None, int | None] = (None, None), bidi: bool = False,
    ) -> None:  # fmt: skip
        self._rref, self._kind, self._timeout, self._windows = rref, kind, timeout, windows
        self._bidi = bidi

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(self._invoke, name)

    def _invoke(self, name: str, *args: Any, **kwargs: Any) -> Any:
        rref, kind, timeout = self._rref, self._kind, self._timeout
        rref._ctx.check_usable(rref)
        call_args = (rref, name, args, kwargs)
        target = f"RRef.{name}"  # what the hooks (and the profiler) call it
        if kind is CallKind.STREAM:
            window, window_bytes = self._windows
            if self._bidi:  # the requests go first, before the proxy's own arguments
                return open_bidi(rref._owner, _bidi_method, call_args, {}, timeout, window,
                                 target, window_bytes=window_bytes)  # fmt: skip
            streams = _STREAMS.get()
            return streams.open(rref._owner, _stream_method, call_args, {}, timeout, window,
                                target, window_bytes=window_bytes)  # fmt: skip
        ops = _RREFS.get()
        if kind is CallKind.REMOTE:
            _check_method(rref, name, timeout)
            return ops.remote(rref._owner, _invoke_method, call_args, {}, timeout, target)
        future = ops.call(rref._owner, _invoke_method, call_args, timeout, kind, target)
        future = chain(future, functools.partial(owner_lost_as_rref_error, rref.owner_name()))
        return future if kind is CallKind.ASYNC else future.wait()


def _check_method(rref: Proxied, name: str, timeout: float) -> None:
    # As torch does before a remote() through a proxy: the value's type must have the
    # method, else AttributeError now rather than an RRef of the failure. The type is asked
    # of the owner once per handle; in async code (no blocking) the check is left out.
    if asyncio._get_running_loop() is not None:
        return
    value_type = rref._get_type(timeout)
    if not hasattr(value_type, name) and not _is_script_module(value_type):
        raise AttributeError(f"type object {value_type.__name__!r} has no attribute {name!r}")


def _is_script_module(value_type: type) -> bool:
    # ScriptModules resolve their methods at run time
    return issubclass(value_type, torch.jit.ScriptModule | torch._C.ScriptModule)


async def _stream_method(
    rref: Proxied, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Runs on the owner: the iterator ``value.name(*args, **kwargs)`` returns, streamed
    from there (an async one on the loop, a plain one on the pool)."""
    future = rref._value
    assert future is not None
    del rref  # see owner_value
    value = await owner_value(future)
    return getattr(value, name)(*args, **kwargs)


async def _bidi_method(
    requests: Any, rref: Proxied, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Runs on the owner: what ``value.name(requests, *args, **kwargs)`` returns, streamed
    from there as ``_stream_method``'s."""
    future = rref._value
    assert future is not None
    del rref  # see owner_value
    value = await owner_value(future)
    return getattr(value, name)(requests, *args, **kwargs)


async def _invoke_method(
    rref: Proxied, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Runs on the owner: ``value.name(*args, **kwargs)``.

    ``async def``, ``async_execution`` and ``@inline`` methods run on the loop; plain
    methods on the agent's thread pool, so a slow method never stalls the loop.
    """
    future, ctx = rref._value, rref._ctx
    assert future is not None
    del rref  # see owner_value
    value = await owner_value(future)
    method = getattr(value, name)
    if is_coroutine_function(method):
        return await method(*args, **kwargs)
    if not (is_inline(method) or is_async_execution(method)):
        return await ctx.run_in_pool(functools.partial(method, *args, **kwargs))
    result = method(*args, **kwargs)  # on the loop: it returns at once
    if is_async_execution(method):
        return await await_async_result(result)
    return result
