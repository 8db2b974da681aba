"""Client and bidirectional streams, built on server streams run the other way (layer L3).

``StreamArg`` is an iterable sent as a call argument. Pickling it registers the iterable
with this worker's stream hub (``runtime/calls/streams/sources.py``) and sends a handle;
the callee's function gets a ``StreamInput`` for it, which opens an ordinary stream back
to the sender, whose items are the iterable's, the first time it is iterated. Opened
there, inside the function, the stream is the function's own, as a stream it opens
itself is: it ends no later than the request's deadline, and inside a distributed
autograd context its items carry gradients. The ``StreamInput`` tells the sender when it
arrives (a claim: the sender holds the iterable for it, however late it reads) and when it
is dropped unread (the sender closes the iterable); ``Sources`` has an entry's whole life.
A bidirectional stream is a server stream whose function takes a ``StreamArg`` over a
``SendQueue`` first (``open_bidi``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, Generic, TypeVar

from asyncrpc.errors import StreamArgError
from asyncrpc.functions import inline
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.calls.deadline import serving_peer
from asyncrpc.runtime.calls.pipeline import stream_source
from asyncrpc.runtime.calls.streams.bidi import Bidi
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.calls.streams.sources import SendQueue
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.current import FeatureSlot

__all__ = ["StreamArg", "StreamInput", "open_bidi"]

T = TypeVar("T")
_STREAMS: FeatureSlot[StreamHub] = FeatureSlot("streams", "streams")
_TARGET = "asyncrpc.stream_arg"  # the reverse stream's name, for the hooks and profiles


class StreamArg(Generic[T]):
    """An iterable or async iterable passed as a call argument, streamed to the callee.

    Made by ``asyncrpc.stream_arg``. The callee's function gets a ``StreamInput`` of its
    items in its place. Send it once: one callee reads it, once.
    """

    __slots__ = ("_items", "_sent", "timeout", "window", "window_bytes")

    def __init__(
        self, items: Any, timeout: float = UNSET_RPC_TIMEOUT, window: int | None = None,
        window_bytes: int | None = None,
    ) -> None:  # fmt: skip
        if not hasattr(items, "__aiter__") and not hasattr(items, "__iter__"):
            raise TypeError(
                f"stream_arg takes an iterable or an async iterable, got {type(items).__name__}"
            )
        if window is not None and (type(window) is not int or window < 1):
            raise ValueError(f"a stream window must be a positive int, got {window!r}")
        if window_bytes is not None and (type(window_bytes) is not int or window_bytes < 0):
            raise ValueError(f"a stream's window_bytes must be an int >= 0, got {window_bytes!r}")
        self._items = items
        self._sent = False
        self.timeout, self.window, self.window_bytes = timeout, window, window_bytes

    def __repr__(self) -> str:
        state = "sent" if self._sent else "unsent"
        return f"<StreamArg of {type(self._items).__name__} ({state})>"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled on the calling thread, for the request that carries it: the iterable is
        # held here until the callee opens it (see Sources for how long).
        if self._sent:
            raise StreamArgError("a stream argument can be sent once; make another one")
        hub = _STREAMS.get()
        self._sent = True
        source_id = hub.sources.add(self._items)
        self._items = None  # the hub holds it now
        handle = (hub.worker_name, source_id, self.timeout, self.window, self.window_bytes)
        return StreamInput, (handle,)


# Where a stream argument comes from: the sender's name, its id there, and the item
# timeout and windows the sender asked for.
Handle = tuple[str, int, float, int | None, int | None]


class StreamInput(Generic[T]):
    """A stream argument as the callee's function gets it: iterate it with ``async for``
    (or ``for`` off the agent's loop), like a ``Stream``; it opens on first use.

    Closing it (``close``, ``async with``/``with``, dropping it) stops the sender's
    iterable. Passed on to another call unopened, it is read there instead.
    """

    __slots__ = ("__weakref__", "_handle", "_stream")

    def __init__(self, handle: Handle) -> None:
        self._handle: Handle | None = handle
        self._stream: Stream[T] | None = None
        # Unpickled: tell the sender it arrived (it then holds it for us, unexpired), from
        # the loop, after the unpickling that made this object.
        _schedule(_tell, handle, _claimed)

    def __repr__(self) -> str:
        if self._stream is not None:
            return f"<StreamInput {self._stream!r}>"
        return f"<StreamInput from {self._handle[0]!r}>" if self._handle else "<StreamInput>"

    def _open(self) -> Stream[T]:
        stream = self._stream
        if stream is None:
            handle, self._handle = self._handle, None
            if handle is None:
                raise StreamArgError("this stream argument was closed or passed on")
            stream = self._stream = _open(handle)
        return stream

    # ``async for``/``for`` iterate the opened ``Stream`` itself: nothing between it and
    # the items.
    def __aiter__(self) -> Stream[T]:
        return self._open()

    def __anext__(self) -> Awaitable[T]:
        return self._open().__anext__()

    def __iter__(self) -> Stream[T]:
        return self._open()

    def __next__(self) -> T:
        return self._open().__next__()

    def close(self) -> None:
        """Stop the stream: the sender's iterable is closed. Returns at once; idempotent."""
        stream, self._stream = self._stream, None
        handle, self._handle = self._handle, None
        if stream is not None:
            stream.close()
        elif handle is not None:
            _release(handle)

    async def aclose(self) -> None:
        """``close``, for ``async with`` and async code."""
        self.close()

    def __enter__(self) -> StreamInput[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> StreamInput[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Passed on unopened: the next callee reads it from the sender directly.
        if self._handle is None:
            raise StreamArgError("a stream argument being read cannot be passed on")
        handle, self._handle = self._handle, None
        return StreamInput, (handle,)

    def __del__(self) -> None:
        # Never I/O here: an unopened one is released from the agent's loop (a function
        # that never reads its stream argument still lets the sender close it).
        handle = getattr(self, "_handle", None)
        if handle is None:
            return
        self._handle = None
        _schedule(_tell, handle, _discarded)


def _open(handle: Handle) -> Stream[Any]:
    sender, source_id, timeout, window, window_bytes = handle
    return _STREAMS.get().open(
        sender, _source_items, (source_id,), {}, timeout, window, _TARGET,
        window_bytes=window_bytes, serving=True,
    )  # fmt: skip


def _release(handle: Handle) -> None:
    """Tell the sender its iterable will not be read: it closes it."""
    _tell(handle, _discarded)


def _schedule(fn: Any, *args: Any) -> None:
    try:
        _STREAMS.get().loop.aio.call_soon_threadsafe(fn, *args)
    except Exception:  # no agent, or a closed loop: the sender's expiry or shutdown ends it
        return


def _tell(handle: Handle, fn: Any) -> None:
    """Call ``fn(source_id)`` on the handle's sender and forget it (on the loop)."""
    try:
        hub = _STREAMS.get()
    except Exception:  # shut down meanwhile
        return
    hub.notify(handle[0], fn, (handle[1],))


@inline
def _claimed(source_id: int) -> None:
    """Runs on the sender: the handle of ``source_id`` reached the calling worker."""
    peer = serving_peer()
    if peer is not None:
        _STREAMS.get().sources.claim(source_id, peer)


@inline
def _discarded(source_id: int) -> None:
    """Runs on the sender: the callee dropped ``source_id`` unread."""
    _STREAMS.get().sources.discard(source_id)


@stream_source
@inline
def _source_items(source_id: int) -> Any:
    """Runs on the sender, as a stream's function: the iterable sent as ``source_id``
    (an async one is advanced on the loop, a plain one on the pool)."""
    # Inline: run as the request is read, before a close behind it on the same
    # connection, so the producer owns the iterable (and closes it) from then on. A task
    # would be cancelled unstarted by that close, and the iterable left in the table.
    return _STREAMS.get().sources.take(source_id)


def open_bidi(
    to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
    window: int | None, target: str | None = None, total_timeout: float = 0.0,
    window_bytes: int | None = None,
) -> Bidi[Any]:  # fmt: skip
    """Start ``fn(requests, *args, **kwargs)`` on ``to`` as a bidirectional stream.

    ``timeout``, ``window`` and ``window_bytes`` hold for both directions (each wait for a
    request on the callee, and for a reply here); ``total_timeout`` for the whole call.

    Raises:
        As ``StreamHub.open``, at once.
    """
    hub = _STREAMS.get()
    loop = hub.loop
    queue = SendQueue(loop.aio, hub.default_window if window is None else window)
    requests: StreamArg[Any] = StreamArg(queue, timeout, window, window_bytes)
    replies = hub.open(
        to, fn, (requests, *args), kwargs, timeout, window, target,
        total_timeout=total_timeout, window_bytes=window_bytes,
    )  # fmt: skip
    return Bidi(replies, queue, loop.thread_id, loop.run_on_loop)
