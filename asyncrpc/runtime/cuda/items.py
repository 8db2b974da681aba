"""CUDA tensors in stream items, on the path a call's tensors take (layer L2.45).

A stream's items are pickled one after another (on the loop, or on the one pool thread
advancing a plain generator), and unpickled one after another on the loop, so one policy
object serves a whole stream in each direction, and hands each item its own
``StagedCopy``: its events, chunks and received tensors are that item's, never its
neighbours'.

- ``ItemCopies`` (producer): each item's CUDA tensors are staged through pinned memory on
  the copy-out streams, after the producer's work recorded on the pickling thread's
  current streams, under the stream's device map; ``take`` gives what the item's frame
  waits for (the send gate, polled on the loop) and starts the next item.
- ``ItemArrivals`` (consumer): each item's segments are copied to their devices on the
  copy-in streams; ``take`` gives what the thread that reads the item calls first (its
  current streams wait on that item's copies), never a host wait.

Items go staged, not by CUDA IPC handle: a handle's block is given back through header
fields of later messages, and a stream's credit frames carry none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.runtime.calls.pipeline import ItemsIn

__all__ = ["ItemArrivals", "ItemCopies", "Staging"]


class Staging(Protocol):
    """What the items' policies ask of the transfer that made them (``StagedTransfer``)."""

    def policy(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        """A fresh policy of one message (its own events and received tensors)."""
        ...

    def ready(self, policy: TensorPolicy) -> Awaitable[None] | None:
        """What a frame pickled under ``policy`` waits for before it is written."""
        ...

    def before_use(self, policy: TensorPolicy) -> Callable[[], None] | None:
        """What the first thread to use tensors unpickled under ``policy`` calls first."""
        ...


class ItemCopies(TensorPolicy):
    """The tensor policy of the items one stream sends (see the module's docstring)."""

    __slots__ = ("_copy", "_map", "_transfer")

    def __init__(self, transfer: Staging, device_map: Mapping[str, str]) -> None:
        self._transfer = transfer
        self._map = device_map
        self._copy: TensorPolicy | None = None  # the item being pickled, once it met a tensor

    @property
    def device_map(self) -> Mapping[str, str]:
        return self._map

    def to_host(self, tensor: Any) -> tuple[str, Any]:
        copy = self._copy
        if copy is None:  # the first CUDA tensor of this item
            copy = self._copy = self._transfer.policy(self._map)  # no peer: no IPC handle
        return copy.to_host(tensor)

    def take(self) -> Awaitable[None] | None:
        """What the frame of the item just pickled waits for (None: nothing, its copies
        are done or it had no CUDA tensor); the next item starts afresh. Call it on the
        thread that pickled the item, before the next one is pickled."""
        copy, self._copy = self._copy, None
        return None if copy is None else self._transfer.ready(copy)


class ItemArrivals(ItemsIn):
    """The tensor policy of the items one stream receives (see the module's docstring)."""

    __slots__ = ("_copy", "_peer", "_transfer")

    def __init__(self, transfer: Staging, peer: int) -> None:
        self._transfer = transfer
        self._peer = peer
        self._copy: TensorPolicy | None = None

    def to_device(self, segment: Any, device: str) -> Any:
        copy = self._copy
        if copy is None:  # the first segment of this item bound for a device
            copy = self._copy = self._transfer.policy({}, self._peer)  # receiving: no map
        return copy.to_device(segment, device)

    def take(self) -> Callable[[], None] | None:
        """What the thread that reads the item just unpickled calls first (None: it
        brought nothing to a device); the next item starts afresh."""
        copy, self._copy = self._copy, None
        return None if copy is None else self._transfer.before_use(copy)
