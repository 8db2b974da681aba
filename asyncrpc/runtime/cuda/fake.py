"""``FakeDevices``: the device seam on the CPU, for tests (layer L2).

A stream is an in-order queue of simulated work; a test launches work on it and lets it
run (``run``), so GPU progress happens exactly when the test says. An event recorded on
a stream completes once every item queued before it has; ``wait`` queues an item that
completes only after its event, so later work on that stream is ordered behind it, as on
a GPU. Current streams are per thread, as CUDA's are. Counters let tests check that the
code above the seam made the calls it should (and no more).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from asyncrpc.runtime.cuda.devices import GpuIdentity

__all__ = ["FakeDevices", "FakeEvent", "FakeStream", "FakeTensor", "FakeWork"]


@dataclass(eq=False)
class FakeWork:
    """One item queued on a stream: a kernel (``after`` None) or a wait on an event."""

    label: str
    after: FakeEvent | None = None
    done: bool = False


@dataclass(eq=False)
class FakeStream:
    device: int
    name: str
    items: list[FakeWork] = field(default_factory=list)

    def pending(self) -> list[FakeWork]:
        return [item for item in self.items if not item.done]


@dataclass(eq=False)
class FakeEvent:
    """Completes once the first ``upto`` items of ``stream`` have."""

    stream: FakeStream
    upto: int

    def done(self) -> bool:
        return all(item.done for item in self.stream.items[: self.upto])


@dataclass(eq=False)
class FakeTensor:
    """A stand-in for a tensor on fake device ``fake_device`` (None: on the CPU)."""

    fake_device: int | None
    value: Any = None


class FakeDevices:
    """The seam, simulated. ``count`` devices; ``identity`` is what ``identity()`` says."""

    def __init__(self, count: int = 2, identity: GpuIdentity | None = None) -> None:
        self.count = count
        self._identity = identity or GpuIdentity(
            "fake-boot", tuple(f"GPU-fake-{i}" for i in range(count))
        )
        self._defaults = [FakeStream(d, f"default{d}") for d in range(count)]
        self._current = threading.local()
        self.streams_made = 0
        self.records = 0
        self.waits = 0
        self.copies = 0
        self.host_buffers = 0
        self.kept: list[tuple[Any, FakeStream]] = []

    # -- the seam ------------------------------------------------------------------------

    def device_of(self, tensor: Any) -> int | None:
        device = getattr(tensor, "fake_device", None)
        if device is not None and not 0 <= device < self.count:
            raise ValueError(f"fake device {device} does not exist ({self.count} devices)")
        return device

    def current_stream(self, device: int) -> FakeStream:
        current: dict[int, FakeStream] = getattr(self._current, "streams", {})
        return current.get(device, self._defaults[device])

    def new_stream(self, device: int) -> FakeStream:
        self.streams_made += 1
        return FakeStream(device, f"stream{self.streams_made}")

    @contextmanager
    def use_streams(self, streams: list[FakeStream]) -> Iterator[None]:
        before: dict[int, FakeStream] = dict(getattr(self._current, "streams", {}))
        self._current.streams = {**before, **{s.device: s for s in streams}}
        try:
            yield
        finally:
            self._current.streams = before

    def record(self, stream: FakeStream) -> FakeEvent:
        self.records += 1
        return FakeEvent(stream, len(stream.items))

    def done(self, event: FakeEvent) -> bool:
        return event.done()

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.waits += 1
        stream.items.append(FakeWork(f"wait for {event.stream.name}", after=event))

    def keep(self, tensor: Any, stream: FakeStream) -> None:
        self.kept.append((tensor, stream))

    def host_buffer(self, nbytes: int) -> Any:
        import torch

        self.host_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8)  # "pinned": the CPU has nothing else

    def stage_out(self, tensor: Any, stream: FakeStream) -> FakeTensor:
        self.copies += 1
        copy = FakeTensor(None, getattr(tensor, "value", tensor))
        stream.items.append(FakeWork(f"copy to host on {stream.name}"))
        return copy

    def stage_in(self, segment: Any, device: int, stream: FakeStream) -> FakeTensor:
        self.copies += 1
        stream.items.append(FakeWork(f"copy to device {device} on {stream.name}"))
        return FakeTensor(device, segment)

    def identity(self) -> GpuIdentity:
        return self._identity

    # -- what tests drive ----------------------------------------------------------------

    def default_stream(self, device: int) -> FakeStream:
        return self._defaults[device]

    def launch(self, stream: FakeStream, label: str = "kernel") -> FakeWork:
        """Queue a kernel on ``stream`` (it runs when the test calls ``run``)."""
        work = FakeWork(label)
        stream.items.append(work)
        return work

    def run(self, stream: FakeStream, items: int | None = None) -> int:
        """Complete up to ``items`` (all if None) of ``stream``'s queued items, in order,
        stopping at a wait whose event has not completed; returns how many completed."""
        completed = 0
        for item in stream.pending():  # bounded by the queue
            if items is not None and completed >= items:
                break
            if item.after is not None and not item.after.done():
                break
            item.done = True
            completed += 1
        return completed
