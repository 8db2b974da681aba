"""Client and bidirectional streams, built on server streams run the other way (layer L3).

``StreamArg`` is an iterable sent as a call argument. Pickling it registers the iterable
with this worker's stream hub (``runtime/calls/streams/sources.py``) and sends a handle;
unpickling the handle on the callee opens an ordinary stream back to the sender, whose
items are the iterable's, so the callee's function gets a ``Stream``. The callee opens it
as soon as the request is read, before its function starts: the first items are on their
way while the function starts, and a function that never reads it still closes it (the
``Stream``, dropped with the arguments, closes itself). A bidirectional stream is a server
stream whose function takes a ``StreamArg`` over a ``SendQueue`` first (``open_bidi``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from asyncrpc.errors import StreamArgError
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.calls.streams.bidi import Bidi
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.calls.streams.sources import SendQueue
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.current import FeatureSlot

__all__ = ["StreamArg", "open_bidi"]

T = TypeVar("T")
_STREAMS: FeatureSlot[StreamHub] = FeatureSlot("streams", "streams")
_TARGET = "asyncrpc.stream_arg"  # the reverse stream's name, for the hooks and profiles


class StreamArg(Generic[T]):
    """An iterable or async iterable passed as a call argument, streamed to the callee.

    Made by ``asyncrpc.stream_arg``. The callee's function gets a ``Stream`` of its items
    in its place. Send it once: one callee reads it, once.
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
        return _open_input, handle


def _open_input(
    sender: str, source_id: int, timeout: float, window: int | None, window_bytes: int | None
) -> Stream[Any]:
    """Runs where the handle is unpickled: the ``Stream`` of the sender's items."""
    return _STREAMS.get().open(
        sender, _source_items, (source_id,), {}, timeout, window, _TARGET,
        window_bytes=window_bytes, serving=True,
    )  # fmt: skip


async def _source_items(source_id: int) -> Any:
    """Runs on the sender, as a stream's function: the iterable sent as ``source_id``
    (an async one is advanced on the loop, a plain one on the pool)."""
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
    return Bidi(replies, queue, loop.run_on_loop)
