"""Streaming calls: iterate a generator that runs on another worker (layer L4).

``asyncrpc.stream(to, fn, ...)`` and torch-style ``asyncrpc.rpc_stream(to, fn, args=...)``
return a ``Stream``, iterated with ``async for`` or ``for``. The runtime's side is in
``asyncrpc/runtime/calls/streams/hub.py``; the wire's in ``asyncrpc/protocol/wire/stream.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.current import FeatureSlot

__all__ = ["Stream", "rpc_stream", "stream"]

P = ParamSpec("P")
_STREAMS: FeatureSlot[StreamHub] = FeatureSlot("streams", "streams")
T = TypeVar("T")


@overload
def stream(
    to: Any, fn: Callable[P, AsyncIterator[T]], /, *args: P.args, **kwargs: P.kwargs
) -> Stream[T]: ...


@overload
def stream(
    to: Any, fn: Callable[P, Iterator[T]], /, *args: P.args, **kwargs: P.kwargs
) -> Stream[T]: ...


def stream(to: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Stream[Any]:
    """Run the generator ``fn(*args, **kwargs)`` on worker ``to`` and iterate its items.

    An ``async def`` generator runs on the callee's loop, a plain one on its thread pool.
    Items arrive in order, exactly once; tensors in them travel like call arguments. The
    producer runs at most ``RpcBackendOptions.stream_window`` items ahead of the consumer,
    and makes its next item only while those hold fewer than
    ``RpcBackendOptions.stream_window_bytes`` bytes.
    Each wait for an item is bounded by the default ``rpc_timeout``. Leaving the iteration
    early (``break``, ``close()``, leaving ``async with``), cancelling the consuming task or
    a timeout stops the producer: its generator is closed on the callee, running its
    ``finally`` blocks. Inside a function served for a peer, the stream also ends at that
    request's deadline (``rpc_stream``'s ``total_timeout`` sets a limit of its own).

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        fn: a generator function (``def`` with ``yield``, or ``async def`` with
            ``yield``), or a function returning an iterator or async iterator.
        *args: positional arguments, pickled as for ``call``.
        **kwargs: keyword arguments, all passed to ``fn``.

    Returns:
        The ``Stream``: an async iterator, an iterator (``for`` blocks the calling thread)
        and a (async) context manager that closes it on exit.

    Raises:
        UnknownWorkerError: ``to`` names no worker (at once).
        SerializationError: an argument cannot be pickled (at once).
        Exception: while iterating, the producer's exception as its original type, after
            the items yielded before it.
        RpcTimeoutError: while iterating, no item within the default ``rpc_timeout`` (the
            stream is closed).
        PeerLostError: while iterating, the producer's worker was lost (after the items
            already received).
        ClosedError: while iterating, this worker shut down.
        BlockingCallError: ``for`` on the agent's loop thread.
    """
    return _STREAMS.get().open(to, fn, args, kwargs, UNSET_RPC_TIMEOUT, None)


def rpc_stream(
    to: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
    window: int | None = None,
    total_timeout: float = 0.0,
    window_bytes: int | None = None,
) -> Stream[Any]:
    """``stream`` with torch-style arguments.

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        fn: as for ``stream``.
        args: positional arguments.
        kwargs: keyword arguments.
        timeout: seconds each wait for the next item may last (``RpcTimeoutError``, which
            also closes the stream); -1: the default ``rpc_timeout``, 0: no limit.
        window: items the producer may run ahead of the consumer (default:
            ``RpcBackendOptions.stream_window``).
        total_timeout: seconds the whole stream may last (0: no limit): then the
            producer's generator is closed on the callee (its ``finally`` runs) and the
            consumer gets ``RpcTimeoutError`` after the items received before. Inside a
            function served for a peer, a stream ends no later than that request's
            deadline, as calls do (``inherit_deadlines``).
        window_bytes: bytes the producer may run ahead: it makes its next item only while
            the items not yet consumed hold fewer bytes (payload and tensor segments), and
            an item larger than this still goes, alone (default:
            ``RpcBackendOptions.stream_window_bytes``; 0: count items only).

    Returns:
        The ``Stream``.

    Raises:
        ValueError: ``window`` is not a positive int, or ``window_bytes`` not an int >= 0.
            Else as ``stream``.
    """
    return _STREAMS.get().open(
        to, fn, tuple(args or ()), dict(kwargs or {}), timeout, window,
        total_timeout=total_timeout, window_bytes=window_bytes,
    )  # fmt: skip
