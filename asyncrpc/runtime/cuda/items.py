"""CUDA tensors in stream items, on the path a call's tensors take (layer L2.45).

A stream's items are pickled one after another (on the loop, or on the one pool thread
advancing a plain generator), and unpickled one after another on the loop, so one policy
object serves a whole stream in each direction, and hands each item its own
``StagedCopy``: its events, chunks, blocks and received tensors are that item's, never
its neighbours'.

- ``ItemCopies`` (producer): each item's CUDA tensors go as a call's would to the stream's
  consumer: by CUDA IPC handle where a call to that peer would use one (same host, probe
  passed, ``cuda_transfer`` "auto" or "ipc"), else staged through pinned memory on the
  copy-out streams, after the producer's work recorded on the pickling thread's current
  streams, under the stream's device map; ``take`` gives what the item's frame waits for
  (the send gate, polled on the loop) and the bytes it holds by handle, and starts the
  next item.
- ``ItemArrivals`` (consumer): each item's segments are copied to their devices on the
  copy-in streams (out of the producer's block, for a handle); ``take`` gives what the
  thread that reads the item calls first (its current streams wait on that item's
  copies), never a host wait.
- ``IpcStreamLinks`` (both ends): a block lent for an item comes back to its producer
  named in the IPC field (``ipc.STREAM_FIELD``) of the frames that flow the other way:
  the consumer's credit and close frames, the items of a bidirectional stream's other
  direction, a stream's end; and, once a consumed stream is over, one last close frame
  as soon as the copies out of its last blocks are done (``owed``), so a stream with
  only credit flowing back leaves no block lent.

Bound: an item sent by handle costs its tensors' bytes in the stream's byte credit, as
its staged copy would: a producer stops at the consumer's byte window whichever way the
bytes go, so a stalled consumer holds at most the window (plus one item) of the
producer's blocks unread. One that reads holds besides the blocks its last credit
acknowledged while their copies out were still running (named back with its next frame):
at most twice the window of blocks lent, in items and in bytes. Blocks are sized in powers
of two (``blocks.py``), so the device memory behind them is at most twice their bytes,
and never more than the per-peer bound of ``blocks.py`` (past it, items go staged).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.runtime.calls.pipeline import ItemsIn, StreamLinks
from asyncrpc.runtime.cuda.devices import Devices, Event
from asyncrpc.runtime.cuda.gate import FIRST_POLL_S, MAX_POLL_S
from asyncrpc.runtime.cuda.ipc import STREAM_FIELD, IpcLinks

__all__ = ["IpcStreamLinks", "ItemArrivals", "ItemCopies", "Staging"]


class Staging(Protocol):
    """What the items' policies ask of the transfer that made them (``StagedTransfer``)."""

    def policy(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        """A fresh policy of one message (its own events and received tensors)."""
        ...

    def ready(self, policy: TensorPolicy) -> Awaitable[None] | None:
        """What a frame pickled under ``policy`` waits for before it is written."""
        ...

    def held(self, policy: TensorPolicy) -> int:
        """The bytes a message pickled under ``policy`` sent by handle (in the peer's
        blocks, not in the frame)."""
        ...

    def before_use(self, policy: TensorPolicy) -> Callable[[], None] | None:
        """What the first thread to use tensors unpickled under ``policy`` calls first."""
        ...


class ItemCopies(TensorPolicy):
    """The tensor policy of the items one stream sends (see the module's docstring)."""

    __slots__ = ("_copy", "_map", "_peer", "_transfer")

    def __init__(
        self, transfer: Staging, device_map: Mapping[str, str], peer: int | None = None
    ) -> None:
        self._transfer = transfer
        self._map = device_map
        self._peer = peer  # the consumer: by handle where a call to it would go so
        self._copy: TensorPolicy | None = None  # the item being pickled, once it met a tensor

    @property
    def device_map(self) -> Mapping[str, str]:
        return self._map

    def to_host(self, tensor: Any) -> tuple[str, Any]:
        copy = self._copy
        if copy is None:  # the first CUDA tensor of this item
            copy = self._copy = self._transfer.policy(self._map, self._peer)
        return copy.to_host(tensor)

    def take(self) -> tuple[Awaitable[None] | None, int]:
        """What the frame of the item just pickled waits for (None: nothing, its copies
        are done or it had no CUDA tensor), and the bytes it sent by handle; the next
        item starts afresh. Call it on the thread that pickled the item, before the next
        one is pickled."""
        copy, self._copy = self._copy, None
        if copy is None:
            return None, 0
        transfer = self._transfer
        return transfer.ready(copy), transfer.held(copy)


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


class IpcStreamLinks(StreamLinks):
    """The CUDA IPC field on the stream frames between this worker and one same-host peer
    (see the module's docstring): offers, answers and blocks named back, as calls carry
    them in their own field."""

    __slots__ = ("_ipc", "_peer")

    def __init__(self, ipc: IpcLinks, peer: int) -> None:
        self._ipc, self._peer = ipc, peer

    def fields(self) -> dict[str, Any] | None:
        value = self._ipc.field_out(self._peer)
        return None if value is None else {STREAM_FIELD: value}

    def owed(self) -> Awaitable[None] | None:
        events = self._ipc.owed(self._peer)
        return _Copied(self._ipc.devices, events) if events else None

    def dropped(self, tags: Sequence[str]) -> None:
        self._ipc.unread(self._peer, list(tags))

    def unsent(self, tags: Sequence[str]) -> None:
        self._ipc.unsent(self._peer, list(tags))


class _Copied:
    """Done once these copies out of a peer's blocks are (polled on the loop with the send
    gate's backoff, never blocking it); started only once awaited."""

    __slots__ = ("_devices", "_events")

    def __init__(self, devices: Devices, events: list[Event]) -> None:
        self._devices, self._events = devices, events

    def __await__(self) -> Generator[Any, None, None]:
        return self._poll().__await__()

    async def _poll(self) -> None:
        done, delay = self._devices.done, FIRST_POLL_S
        while not all(done(event) for event in self._events):  # bounded by the copies
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)
