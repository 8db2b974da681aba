"""When a frame carrying CUDA tensors may leave, and how a receiver's streams are ordered
after it: torch's stream rules without host syncs, above the device seam (layer L2.45).

Sender (torch's rule 1, and rule 3 for replies): at send time one event is recorded on the
sending thread's current stream of each device the frame's tensors live on; the frame is
written once those events are done. ``SendGate.ready`` awaits that on the loop by polling
the events with a growing backoff, so neither the caller's thread nor the loop blocks on
GPU work. Frames through one gate leave in the order they entered it: a frame whose
events are done still waits for the frames queued before it (frames to one peer keep
their order on the wire).

Receiver (rules 2 and 4): ``order_after`` makes the given streams (the pool streams a
callee runs on, or the current streams of a thread waiting on a reply) wait on a frame's
events, so their work runs after the data is ready and the host never waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrpc.runtime.cuda.devices import CudaStream, Devices, Event, devices_of

__all__ = ["FrameEvents", "SendGate", "device_index", "order_after", "record_for"]

FIRST_POLL_S = 20e-6  # kernels that are already done cost one short sleep at most
MAX_POLL_S = 1e-3  # a long kernel costs ~1,000 polls a second, none of them blocking


@dataclass(frozen=True, slots=True)
class FrameEvents:
    """The events a frame waits for: one per device its tensors live on."""

    events: tuple[tuple[int, Event], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.events)


def record_for(devices: Devices, tensors: Iterable[Any]) -> FrameEvents:
    """Record, on the calling thread's current stream of each device among ``tensors``,
    the event the frame carrying them must wait for. Call it on the thread that produced
    them (the caller of ``rpc_async``, or the callee once its function has returned)."""
    return FrameEvents(
        tuple((d, devices.record(devices.current_stream(d))) for d in devices_of(devices, tensors))
    )


def order_after(devices: Devices, streams: Sequence[CudaStream], frame: FrameEvents) -> None:
    """Make each of ``streams`` wait for the frame's event of its device (no host wait).
    A stream of a device the frame has no event for is left alone."""
    by_device = dict(frame.events)
    for stream in streams:
        device = device_index(stream)
        event = None if device is None else by_device.get(device)
        if event is not None:
            devices.wait(stream, event)


def device_index(stream: CudaStream) -> int | None:
    device = getattr(stream, "device", None)  # torch.cuda.Stream and FakeStream have it
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    return index if isinstance(index, int) else None


class SendGate:
    """Holds frames until the GPU work that produced their tensors is done, in order.

    One per connection (or per peer). ``ready`` is awaited on the loop before a frame is
    written. A frame with no events, entering an idle gate, passes without awaiting.
    """

    def __init__(
        self, devices: Devices, *, first_poll: float = FIRST_POLL_S, max_poll: float = MAX_POLL_S
    ) -> None:
        self._devices = devices
        self._first_poll = first_poll
        self._max_poll = max_poll
        self._tail: asyncio.Future[None] | None = None  # the last frame still held
        self.held = 0  # frames that had to wait (for tests and metrics)
        self.polls = 0

    def idle(self) -> bool:
        return self._tail is None or self._tail.done()

    def passes(self, frame: FrameEvents) -> bool:
        """Whether ``frame`` may be written now, without awaiting ``ready``: no frame is
        held before it and its events are done (asked, never waited for)."""
        return self.idle() and self._all_done(frame)

    async def ready(self, frame: FrameEvents) -> None:
        """Return once the frame's events are done and every frame queued before it has
        left. Cancelling the wait lets the frames behind it go on (the frame is dropped)."""
        if self.passes(frame):
            return
        self.held += 1
        before, mine = self._tail, asyncio.get_running_loop().create_future()
        self._tail = mine
        try:
            if before is not None and not before.done():
                await asyncio.shield(before)
            delay = self._first_poll
            while not self._all_done(frame):  # bounded by the GPU work, polled
                self.polls += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_poll)
        finally:
            if before is not None and not before.done():
                # Cancelled while queued: the frames behind this one still wait for those
                # before it (a cancelled frame frees its place, not theirs).
                before.add_done_callback(lambda _: _settle(mine))
            else:
                _settle(mine)

    def _all_done(self, frame: FrameEvents) -> bool:
        return all(self._devices.done(event) for _, event in frame.events)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
