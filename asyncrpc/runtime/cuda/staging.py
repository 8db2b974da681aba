"""CUDA tensors through pinned host memory on side streams, with no host sync (layer L2.45).

torch's stream rules, built on the device seam so all of it runs on ``FakeDevices`` too:

- Sending (rule 1; rule 3 for replies): on the thread that pickles the message, one event
  is recorded on that thread's current stream of each device involved (the producer's
  work so far); a per-device copy-out stream waits on it and copies each tensor into
  pinned host memory (a contiguous one in ``CHUNK_BYTES`` chunks, an event after each,
  into a block of the bounded ``PinnedPool``; others whole). The frame waits in the call
  pipeline's ``ready`` stage until the copies are done (``SendGate``, polled on the
  loop): neither the caller nor the loop waits for the GPU.
- Receiving (rules 2 and 4): each segment is copied to its device on a per-device
  copy-in stream, and an event is recorded after it. Whoever uses the tensors first makes
  its current streams wait on those events: the callee's thread before the function runs,
  the caller's thread when it reads the reply (``Future.value``, so ``wait()``, ``await``
  and ``then`` callbacks alike). The host never waits.

Copies of one device share one stream in each direction: they are ordered, so the last
event recorded on it covers every copy before it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from typing import Any

import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.serde.tensors import _resolved_span, memory_view
from asyncrpc.protocol.wire import Allocator
from asyncrpc.runtime.cuda.callee import CalleeStreams, RequestStreams
from asyncrpc.runtime.cuda.devices import CudaStream, Devices, Event
from asyncrpc.runtime.cuda.gate import (
    FIRST_POLL_S,
    MAX_POLL_S,
    FrameEvents,
    SendGate,
    device_index,
    order_after,
)
from asyncrpc.runtime.cuda.ipc import IpcLinks, is_ipc_tag
from asyncrpc.runtime.cuda.items import IpcStreamLinks, ItemArrivals, ItemCopies
from asyncrpc.runtime.cuda.maps import cuda_index
from asyncrpc.runtime.cuda.parts import Part, frame_parts, split_frame
from asyncrpc.runtime.cuda.pinned import PinnedPool

# Staged tensors are copied to the host in chunks of this size, an event after each, so a
# writer that sends a frame in parts can start once the first chunk is on the host (see
# docs/cuda.md: the links write a frame whole today, after its last chunk).
CHUNK_BYTES = 8 << 20

__all__ = ["CHUNK_BYTES", "StagedCopy", "StagedTransfer", "cuda_transfer"]


def cuda_transfer(
    options: RpcBackendOptions, same_host: Callable[[int], bool] | None = None
) -> StagedTransfer | None:
    """The agent's CUDA transfer where CUDA is set up and wanted, else None (the
    device-map hook then copies through the host). ``cuda_transfer`` "auto" adds CUDA IPC
    to same-host peers whose probe passed, "ipc" to every same-host peer (``same_host``)."""
    mode = options.cuda_transfer
    if mode == "host":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from asyncrpc.runtime.cuda.real import CudaDevices

    transfer = StagedTransfer.from_options(CudaDevices(), options)
    if mode in ("auto", "ipc") and same_host is not None:
        transfer.ipc = IpcLinks(transfer.devices, same_host, mode == "auto", transfer.in_stream)
    return transfer


class StagedTransfer:
    """One agent's staged CUDA transfers: its copy streams, its send gate, and the stream
    pool its callees run on (None: a callee runs on its thread's current streams, made to
    wait)."""

    def __init__(
        self, devices: Devices, gate: SendGate | None = None, callee: CalleeStreams | None = None,
        pinned: PinnedPool | None = None, chunk_bytes: int = CHUNK_BYTES,
    ) -> None:  # fmt: skip
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.devices = devices
        self.gate = gate if gate is not None else SendGate(devices)
        self.callee = callee
        self.pinned = pinned if pinned is not None else PinnedPool(devices)
        self.chunk_bytes = chunk_bytes
        self.chunked = 0  # chunk copies queued (metrics)
        self.ipc: IpcLinks | None = None  # same-host peers by handle (set for "auto"/"ipc")
        self._count: int | None = None  # devices this process sees
        self._out: dict[int, CudaStream] = {}
        self._in: dict[int, CudaStream] = {}
        # id(tensor) -> (the tensor, weakly; where the work that made it ends): remote()
        # values kept here, sent later from other streams (``remember``).
        self._made: dict[int, tuple[weakref.ref[Any], Event]] = {}
        self.staged_out = 0  # tensors copied to the host, and to a device (metrics)
        self.staged_in = 0

    @classmethod
    def from_options(cls, devices: Devices, options: RpcBackendOptions) -> StagedTransfer:
        """A transfer whose callee stream pool and pinned pool are sized by ``options``."""
        callee = CalleeStreams.from_options(devices, options)
        return cls(
            devices, callee=callee, pinned=PinnedPool(devices, options.cuda_pinned_pool_bytes)
        )

    def allocate(self, nbytes: int) -> tuple[object, memoryview]:
        """The wire's allocator for segments tagged with a CUDA device: pinned memory, so
        the copy to the device runs without the host."""
        owner = self.devices.host_buffer(nbytes)
        return owner, memory_view(owner.data_ptr(), nbytes, writable=True)

    def allocator(self, plain: Allocator) -> Allocator:
        """The wire's allocator: segments tagged with a CUDA device land in pinned memory
        (``allocate``), the others where ``plain`` puts them."""

        def allocate(nbytes: int, tag: str) -> tuple[object, memoryview]:
            return self.allocate(nbytes) if tag.startswith("cuda") else plain(nbytes, tag)

        return allocate

    def policy(self, device_map: Mapping[str, str], peer: int | None = None) -> StagedCopy:
        return StagedCopy(self, device_map, peer)

    def items_out(self, device_map: Mapping[str, str], peer: int | None = None) -> ItemCopies:
        """The policy of one stream's items sent to ``peer`` under ``device_map``
        (``items.py``): by handle where a call to ``peer`` would send them so."""
        return ItemCopies(self, device_map, peer)

    def links(self, peer: int) -> IpcStreamLinks | None:
        """The IPC field of the stream frames with ``peer`` (None: no IPC can reach it)."""
        ipc = self.ipc
        return None if ipc is None or not ipc.reaches(peer) else IpcStreamLinks(ipc, peer)

    def held(self, policy: TensorPolicy) -> int:
        """The bytes a message pickled under ``policy`` sent by handle."""
        return policy.shared_bytes if isinstance(policy, StagedCopy) else 0

    def items_in(self, peer: int) -> ItemArrivals:
        """The policy of one stream's items received from ``peer`` (``items.py``)."""
        return ItemArrivals(self, peer)

    def field_out(self, peer: int) -> Any:
        """The IPC header field for the next message to ``peer`` (None: nothing)."""
        return None if self.ipc is None else self.ipc.field_out(peer)

    def field_in(self, peer: int, value: Any) -> None:
        if self.ipc is not None and value is not None:
            self.ipc.field_in(peer, value)

    def remember(self, value: Any, streams: list[CudaStream]) -> None:
        """``value`` (a remote() result kept by its owner) was made on ``streams``: record
        where that work ends, so the first message that sends one of its CUDA tensors,
        from whatever thread and stream, waits for it (torch's owner RRef does the same
        through its future's events). Tensors directly in it, or in a list, tuple or
        dict it is, count."""
        devices = self.devices
        tensors = [t for t in _shallow(value) if devices.device_of(t) is not None]
        if not tensors or not streams:
            return
        events = {device_index(s): devices.record(s) for s in streams}
        for tensor in tensors:
            event = events.get(devices.device_of(tensor))
            if event is None:
                continue
            key = id(tensor)
            self._made[key] = (weakref.ref(tensor), event)
            weakref.finalize(tensor, self._made.pop, key, None)

    def after_made(self, tensor: Any, stream: CudaStream) -> None:
        """Make ``stream`` wait for the work that made ``tensor``, if it was remembered."""
        entry = self._made.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            self.devices.wait(stream, entry[1])

    def on_peer_lost(self, peer: int) -> None:
        if self.ipc is not None:
            self.ipc.on_peer_lost(peer)

    def stats(self) -> dict[str, int]:
        """Counters for ``get_debug_info()``: tensors staged each way, the callee's stream
        leases, and CUDA IPC handles."""
        stats = {"cuda_staged_out": self.staged_out, "cuda_staged_in": self.staged_in}
        stats.update(cuda_staged_chunks=self.chunked, **self.pinned.stats())
        if self.callee is not None:
            pool = self.callee.pool
            stats.update(cuda_stream_leases=pool.leased, cuda_stream_releases=pool.released)
        if self.ipc is not None:
            stats.update(self.ipc.stats())
        return stats

    def ready(self, policy: TensorPolicy) -> Awaitable[None] | None:
        """What a frame sent under ``policy`` waits for (None: nothing was staged): its
        parts (``StagedParts``) when every tensor it stages was copied in several chunks,
        so the links write its first chunks while the next are copied; else its events."""
        if not isinstance(policy, StagedCopy) or not (policy.events or policy.shared):
            return None
        frame = policy.frame_events()
        if self.gate.passes(frame):  # copies already done (small ones often are): no hold
            return None
        if len(policy.chunks) > 1 and not policy.whole and not policy.shared:
            return StagedParts(self, policy)
        return _Held(self.gate, frame)

    def parts(self, policy: TensorPolicy, pieces: list[Any]) -> list[Part]:
        """The frame of ``pieces``, sent under ``policy``, as parts a writer may send one
        after another as their chunks reach the host (``parts.frame_parts``); one part
        waiting for nothing when nothing was staged in chunks."""
        chunks = policy.chunks if isinstance(policy, StagedCopy) else []
        return split_frame(pieces, chunks)

    def before_use(self, policy: TensorPolicy) -> Callable[[], None] | None:
        """What the thread that first uses tensors received under ``policy`` calls first:
        its current streams wait for their copies (None: none were received)."""
        if not isinstance(policy, StagedCopy) or not policy.events:
            return None
        frame = policy.frame_events()
        devices = self.devices
        received = policy.received

        def order_current_streams() -> None:
            streams = [devices.current_stream(device) for device, _ in frame.events]
            order_after(devices, streams, frame)
            # Made on the copy-in stream, read on these: not reused before they are done.
            for device, tensor in received:
                devices.keep(tensor, devices.current_stream(device))

        return order_current_streams

    def serve(self, request: TensorPolicy, reply: TensorPolicy) -> RequestStreams | None:
        """The pool streams a request received under ``request`` runs on, its reply to be
        pickled under ``reply`` (None: no pool, or no device involved)."""
        if self.callee is None:
            return None
        involved = set(request.events) if isinstance(request, StagedCopy) else set()
        replies = reply.streams if isinstance(reply, StagedCopy) else None
        if isinstance(reply, StagedCopy):  # a caller's map may name devices we lack:
            count = self._device_count()  # its tensors fail then, naming them; calls do not
            involved.update(i for i in map(cuda_index, reply.device_map) if i is not None)
            involved = {i for i in involved if i < count}
        if not involved:
            return None
        return self.callee.request(sorted(involved), self.before_use(request), replies)

    def _device_count(self) -> int:
        if self._count is None:  # asked once: identity() asks the driver for each device
            self._count = len(self.devices.identity().uuids)
        return self._count

    def out_stream(self, device: int) -> CudaStream:
        stream = self._out.get(device)
        if stream is None:
            stream = self._out[device] = self.devices.new_stream(device)
        return stream

    def in_stream(self, device: int) -> CudaStream:
        stream = self._in.get(device)
        if stream is None:
            stream = self._in[device] = self.devices.new_stream(device)
        return stream


class _Held:
    """A frame's wait in the send gate, entered only once awaited: a frame dropped
    before that (its call cancelled, the peer lost, a shutdown) leaves no coroutine
    that was never awaited, and takes no place in the gate."""

    __slots__ = ("_frame", "_gate")

    def __init__(self, gate: SendGate, frame: FrameEvents) -> None:
        self._gate, self._frame = gate, frame

    def __await__(self) -> Generator[Any, None, None]:
        return self._gate.ready(self._frame).__await__()


class StagedParts:
    """A staged frame's readiness in parts (``asyncrpc.runtime.net.links.FrameInParts``):
    the links write each part of the frame once its chunk's copy to the host is done, the
    first after the first chunk, so the socket write overlaps the copy of the rest.
    Awaited whole, it waits for every copy like ``SendGate.ready``."""

    __slots__ = ("_policy", "_transfer")

    def __init__(self, transfer: StagedTransfer, policy: StagedCopy) -> None:
        self._transfer, self._policy = transfer, policy

    def parts(self, pieces: list[Any]) -> AsyncIterator[list[Any]]:
        return frame_parts(self._transfer.devices, split_frame(pieces, self._policy.chunks))

    async def started(self) -> None:
        """Return once the first chunk is on the host (polled, never blocking): from then
        on the rest of the frame follows as fast as its copies run, with no wait for the
        producer's work, so a writer may take the connection for it."""
        devices, first = self._transfer.devices, self._policy.chunks[0][2]
        delay = FIRST_POLL_S
        while not devices.done(first):  # bounded by the producer's GPU work, polled
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_POLL_S)

    def __await__(self) -> Generator[Any, None, None]:
        return self._transfer.gate.ready(self._policy.frame_events()).__await__()


class StagedCopy(TensorPolicy):
    """The CUDA half of one message's tensor policy (see the module's docstring)."""

    __slots__ = (
        "_producers", "chunks", "device_map", "events", "peer", "received", "shared",
        "shared_bytes", "streams", "transfer", "whole",
    )  # fmt: skip

    def __init__(
        self, transfer: StagedTransfer, device_map: Mapping[str, str], peer: int | None = None
    ) -> None:
        self.transfer = transfer
        self.device_map = device_map
        self.peer = peer  # the other end (a rank): whether handles may go, whose they are
        self._producers: dict[int, Event] = {}  # device -> the producer's work, recorded once
        self.events: dict[int, Event] = {}  # device -> after this message's last copy
        # device -> the stream the producer's work is on, where it is not the pickling
        # thread's current one (a reply: the callee's leased pool streams).
        self.streams: dict[int, CudaStream] = {}
        self.received: list[tuple[int, Any]] = []  # (device, tensor) copied in
        # Staged bytes by host address: [start, stop) valid once the event completed (a
        # tensor's chunks in order; those of one device are ordered on its copy stream).
        self.chunks: list[tuple[int, int, Event]] = []
        self.whole = False  # a tensor was copied in one piece (not contiguous)
        # (device, event) after each copy into a block for the peer (by handle): the
        # frame leaves once they completed, so the peer reads the blocks without a wait.
        self.shared: list[tuple[int, Event]] = []
        self.shared_bytes = 0  # the bytes those blocks hold for the peer (stream credit)

    def frame_events(self) -> FrameEvents:
        return FrameEvents(tuple(self.events.items()) + tuple(self.shared))

    def to_host(self, tensor: Any) -> tuple[str, Any]:
        transfer = self.transfer
        devices = transfer.devices
        device = devices.device_of(tensor)
        if device is None:
            return super().to_host(tensor)  # not a CUDA tensor: refused with its device
        target = self.device_map.get(f"cuda:{device}")
        if target is None:
            raise SerializationError(
                f"cannot send a tensor on device 'cuda:{device}': the device map has no "
                "entry for it; move the tensor to CPU or map this device to one of the "
                "callee's"
            )
        on = self.streams.get(device)
        transfer.after_made(tensor, on if on is not None else devices.current_stream(device))
        ipc = transfer.ipc
        if ipc is not None and ipc.usable(self.peer):
            shared = self._share(ipc, tensor, device, target, on)
            if shared is not None:
                return shared
        producer = self._producers.get(device)
        if producer is None:
            producer = devices.record(on if on is not None else devices.current_stream(device))
            self._producers[device] = producer
        stream = transfer.out_stream(device)
        devices.wait(stream, producer)
        nbytes = devices.contiguous_nbytes(tensor)
        if nbytes:
            host, self.events[device] = self._copy_chunks(tensor, nbytes, stream)
        else:  # not contiguous (or empty): one copy that keeps its strides, unpooled
            host = devices.stage_out(tensor, stream)
            self.events[device] = devices.record(stream)
            self.whole = True  # its bytes are no chunk's: the frame waits for all
        transfer.staged_out += 1
        return target, host

    def _copy_chunks(self, tensor: Any, nbytes: int, stream: CudaStream) -> tuple[Any, Event]:
        """Copy ``tensor`` into a pinned buffer of the pool, in chunks of the transfer's
        ``chunk_bytes``, an event after each: ``chunks`` says which bytes each event covers
        (where a writer that takes a frame in parts may start on the first one). Returns
        the host tensor and the last chunk's event."""
        transfer = self.transfer
        devices, pool = transfer.devices, transfer.pinned
        flat, block = pool.lend(nbytes)
        address = int(flat.data_ptr())
        step = transfer.chunk_bytes
        for start in range(0, nbytes, step):
            stop = min(start + step, nbytes)
            devices.copy_out(tensor, flat, start, stop, stream)
            event = devices.record(stream)
            self.chunks.append((address + start, address + stop, event))
            transfer.chunked += 1
        pool.filled(block, event)  # nbytes > 0: at least one chunk was copied
        return devices.host_view(flat, tensor), event

    def _share(
        self, ipc: IpcLinks, tensor: Any, device: int, target: str, on: Any
    ) -> tuple[str, Any] | None:
        """By handle, or None where it cannot go so (the driver refused, or the peer's
        blocks are all in use up to their bound): then it goes staged. The copy into the
        block is queued here; the frame waits for its event (``shared``); the segment goes
        empty."""
        assert self.peer is not None
        devices = self.transfer.devices
        stream = on if on is not None else devices.current_stream(device)
        if isinstance(tensor, torch.Tensor):
            with devices.use_streams([stream]):  # conj/neg/contiguous, if any, on that stream
                tensor, _, nbytes = _resolved_span(tensor)  # as the serializer will describe it
        else:  # a FakeTensor: the bytes it says it has
            nbytes = devices.contiguous_nbytes(tensor) or 0
        try:
            exported = ipc.export(self.peer, tensor, nbytes, target, stream)
        except (RuntimeError, ValueError):
            exported = None
        if exported is None:  # refused, or no block free within the bound
            ipc.refused += 1
            return None
        tag, filled = exported
        self.shared.append((device, filled))  # the frame leaves once the fill is done
        self.shared_bytes += nbytes
        return tag, tensor

    def to_device(self, segment: Any, device: str) -> Any:
        if is_ipc_tag(device):
            return self._open(device)
        index = cuda_index(device)
        if index is None:
            return super().to_device(segment, device)
        transfer = self.transfer
        stream = transfer.in_stream(index)
        tensor = transfer.devices.stage_in(segment, index, stream)
        self.events[index] = transfer.devices.record(stream)
        self.received.append((index, tensor))
        transfer.staged_in += 1
        return tensor

    def _open(self, tag: str) -> Any:
        transfer, ipc = self.transfer, self.transfer.ipc
        if ipc is None or self.peer is None:
            raise SerializationError("received a CUDA IPC handle but CUDA IPC is off here")
        try:
            index, tensor = ipc.open(self.peer, tag)
        except (OSError, ValueError) as exc:
            raise SerializationError(f"a CUDA IPC handle could not be opened: {exc}") from exc
        self.events[index] = transfer.devices.record(transfer.in_stream(index))
        self.received.append((index, tensor))
        return tensor


def _shallow(value: Any) -> list[Any]:
    """``value``, or the items of a list, tuple or dict it is (one level)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]
