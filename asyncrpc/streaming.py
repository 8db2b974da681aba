"""Streaming calls: iterate a generator that runs on another worker, stream an argument
to one, or both at once (layer L4).

``asyncrpc.stream(to, fn, ...)`` and torch-style ``asyncrpc.rpc_stream(to, fn, args=...)``
return a ``Stream``, iterated with ``async for`` or ``for``. ``asyncrpc.stream_arg(it)``
passes an iterable to any call as a stream the callee reads as it arrives, and
``asyncrpc.bidi(to, fn, ...)`` opens both directions at once. The runtime's side is in
``asyncrpc/runtime/calls/streams/hub.py`` (client streams: ``asyncrpc/duplex.py``); the
wire's in ``asyncrpc/protocol/wire/stream.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from asyncrpc.duplex import StreamArg, StreamInput, open_bidi
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.calls.streams.bidi import Bidi
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.current import FeatureSlot

__all__ = [
    "Bidi",
    "Stream",
    "StreamArg",
    "StreamInput",
    "bidi",
    "rpc_bidi",
    "rpc_stream",
    "stream",
    "stream_arg",
]

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


def stream_arg(
    items: Iterable[T] | AsyncIterable[T], *, timeout: float = UNSET_RPC_TIMEOUT,
    window: int | None = None, window_bytes: int | None = None,
) -> StreamArg[T]:  # fmt: skip
    """Pass ``items`` to a remote function as a stream it reads as the items arrive.

    Put the result among the arguments of any call (``rpc_sync``, ``rpc_async``,
    ``remote``, ``stream``, RRef proxies): the callee's function gets a ``StreamInput`` in
    its place, to iterate with ``async for`` (or ``for`` in a function that runs on the
    pool) as a ``Stream``; it opens on first use, inside the function.
    This worker advances ``items`` only as the callee's credit allows, as a stream's
    producer: an async iterable on the agent's loop, a plain one on its pool. Items and
    their tensors travel like call arguments. The callee opens the stream as soon as it
    reads the request; one it never reads is closed with the function's arguments, and
    ``items`` is closed then (its ``finally`` runs). Cancelling the call, or its timeout,
    closes it too. An exception raised by ``items`` reaches the callee's iteration as its
    own type, after the items before it.

    Args:
        items: an iterable or async iterable (a generator, a list, a ``Stream``...).
        timeout: seconds each wait of the callee for the next item may last
            (``RpcTimeoutError`` there); -1: the callee's default ``rpc_timeout``, 0: none.
        window: items this worker may run ahead of the callee (default:
            ``RpcBackendOptions.stream_window``).
        window_bytes: bytes it may run ahead, as ``rpc_stream``'s (default:
            ``RpcBackendOptions.stream_window_bytes``; 0: count items only).

    Returns:
        The argument to pass. Send it once: one callee reads it, once.

    Raises:
        TypeError: ``items`` is not iterable.
        ValueError: ``window`` is not a positive int, or ``window_bytes`` not an int >= 0.
        StreamArgError: (when the call is made) it was sent already.
    """
    return StreamArg(items, timeout, window, window_bytes)


def bidi(to: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Bidi[Any]:
    """Open a bidirectional stream: ``fn(requests, *args, **kwargs)`` runs on worker ``to``.

    The callee's function takes the requests first, as a ``StreamInput`` (``async for``),
    and yields replies, as ``stream``'s generator does. The caller gets a ``Bidi``: its
    ``send(item)`` sends a request (``await`` the future it returns, or ``.wait()`` it:
    it completes once the item is queued, which waits while a window of requests is
    unread), ``done_sending()`` ends the requests, and iterating it gives the replies. Both
    directions have their own credit and run independently. Cancellation, errors, peer
    loss and shutdown end it as they end a stream, in both directions: the end of the
    replies ends the sending (``send`` then fails with ``ClosedError``), and a caller that
    leaves early (``close``, ``with``) closes the callee's function.

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        fn: a generator function (``def`` or ``async def`` with ``yield``) taking the
            requests first, or a function returning an iterator or async iterator.
        *args: further positional arguments, pickled as for ``call``.
        **kwargs: keyword arguments.

    Returns:
        The ``Bidi``: a sender, an async iterator and an iterator of replies, and a (async)
        context manager that closes it.

    Raises:
        As ``stream``: at once for a bad destination or argument; while iterating, the
        callee's exception as its own type, ``RpcTimeoutError``, ``PeerLostError``,
        ``ClosedError``.
    """
    return open_bidi(to, fn, args, kwargs, UNSET_RPC_TIMEOUT, None)


def rpc_bidi(
    to: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
    window: int | None = None,
    total_timeout: float = 0.0,
    window_bytes: int | None = None,
) -> Bidi[Any]:
    """``bidi`` with torch-style arguments.

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        fn: as for ``bidi``; ``args`` follow the requests.
        args: positional arguments after the requests.
        kwargs: keyword arguments.
        timeout: seconds each wait may last, for a reply here and for a request on the
            callee (``RpcTimeoutError``, which closes the stream); -1: the default
            ``rpc_timeout``, 0: none.
        window: items each side may run ahead of the other's reading (default:
            ``RpcBackendOptions.stream_window``); also the requests a sender may queue.
        total_timeout: seconds the whole stream may last (0: no limit), as
            ``rpc_stream``'s: then the callee's function is closed and the caller gets
            ``RpcTimeoutError`` after the replies received before.
        window_bytes: bytes each side may run ahead (default:
            ``RpcBackendOptions.stream_window_bytes``; 0: count items only).

    Returns:
        The ``Bidi``.

    Raises:
        ValueError: ``window`` is not a positive int, or ``window_bytes`` not an int >= 0.
            Else as ``bidi``.
    """
    return open_bidi(
        to, fn, tuple(args or ()), dict(kwargs or {}), timeout, window,
        total_timeout=total_timeout, window_bytes=window_bytes,
    )  # fmt: skip
