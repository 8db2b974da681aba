"""``FakeDevices``: the device seam on the CPU, for tests (layer L2.45).

A stream is an in-order queue of simulated work; a test launches work on it and lets it
run (``run``), so GPU progress happens exactly when the test says. An event recorded on
a stream completes once every item queued before it has; ``wait`` queues an item that
completes only after its event, so later work on that stream is ordered behind it, as on
a GPU. Current streams are per thread, as CUDA's are. Counters let tests check that the
code above the seam made the calls it should (and no more).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from asyncrpc.runtime.cuda.devices import GpuIdentity

__all__ = ["FakeDevices", "FakeEvent", "FakeIpc", "FakeStream", "FakeTensor", "FakeWork"]


@dataclass(eq=False)
class FakeWork:
    """One item queued on a stream: a kernel (``after`` None) or a wait on an event;
    ``action`` runs when it completes (a copy's bytes land then)."""

    label: str
    after: FakeEvent | None = None
    done: bool = False
    action: Callable[[], None] | None = None


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
    opened: bool = False  # memory the driver will not share (as opened from another process)
    # Contiguous, of this many bytes (``value`` is then its bytes): copied out in ranges.
    # None: copied out whole (``stage_out``), as a non-contiguous tensor would be.
    nbytes: int | None = None
    host: Any = None  # the host bytes a staged copy lives in (kept alive with it)
    handle: int | None = None  # an exported block's handle (FakeIpc)


@dataclass(eq=False)
class _Shared:
    owner: int  # the id() of the FakeDevices (the "process") that exported it
    uuid: str
    value: Any = None  # what the last fill put in it
    refs: int = 0  # openers' references, as torch's shared ref counter counts them
    dropped: bool = False  # the producer let go of its block (collect may free it)


class FakeIpc:
    """One host's CUDA IPC, simulated: exported blocks by handle, with torch's reference
    counting as a GPU showed it (an opener's mapping counts one reference, taken when it
    opens; closing the mapping or ``unshare`` drops it; ``collect`` frees blocks their
    producer let go of and nobody references). Give
    the same instance to the ``FakeDevices`` of every "process" on one host."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.shared: dict[int, _Shared] = {}
        self.opened = 0
        self.freed = 0
        self.over_released = 0  # references dropped twice (a bug above the seam)
        self.refuse = False  # every open fails (a driver that says no)

    def live(self) -> int:
        """Blocks still allocated for sharing (held, referenced, or not collected yet)."""
        return len(self.shared)

    def referenced(self) -> int:
        return sum(1 for entry in self.shared.values() if entry.refs > 0)

    def drop(self, handle: int) -> None:
        entry = self.shared.get(handle)
        if entry is None or entry.refs <= 0:
            self.over_released += 1
            return
        entry.refs -= 1

    def _let_go(self, handle: int) -> None:
        entry = self.shared.get(handle)
        if entry is not None:
            entry.dropped = True


@dataclass(eq=False)
class FakeMapping:
    """A block mapped by a consumer (``open_block``)."""

    handle: int
    entry: _Shared


class FakeDevices:
    """The seam, simulated. ``count`` devices; ``identity`` is what ``identity()`` says;
    ``ipc`` the host's simulated CUDA IPC (one per FakeDevices unless given)."""

    def __init__(
        self, count: int = 2, identity: GpuIdentity | None = None, ipc: FakeIpc | None = None
    ) -> None:
        self.count = count
        self._identity = identity or GpuIdentity(
            "fake-boot", tuple(f"GPU-fake-{i}" for i in range(count))
        )
        self.ipc = ipc if ipc is not None else FakeIpc()
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
        return torch.zeros(nbytes, dtype=torch.uint8)  # "pinned": the CPU has nothing else

    def stage_out(self, tensor: Any, stream: FakeStream) -> FakeTensor:
        self.copies += 1
        copy = FakeTensor(None, getattr(tensor, "value", tensor))
        stream.items.append(FakeWork(f"copy to host on {stream.name}"))
        return copy

    def contiguous_nbytes(self, tensor: Any) -> int | None:
        nbytes: int | None = getattr(tensor, "nbytes", None)
        return nbytes

    def copy_out(self, tensor: Any, host: Any, start: int, stop: int, stream: FakeStream) -> None:
        import torch

        self.copies += 1
        source = bytes(tensor.value[start:stop])
        # A queued copy does not keep its destination alive (nor does one on a GPU: the
        # pinned pool's fill event keeps a freed buffer from reuse). One whose destination
        # was freed meanwhile lands nowhere here.
        destination = weakref.ref(host)

        def land() -> None:  # the bytes are in host memory only once the copy has run
            target = destination()
            if target is not None:
                target[start:stop] = torch.frombuffer(bytearray(source), dtype=torch.uint8)

        stream.items.append(FakeWork(f"copy {start}:{stop} to host on {stream.name}", action=land))

    def host_view(self, host: Any, like: Any) -> FakeTensor:
        return FakeTensor(None, getattr(like, "value", None), nbytes=int(host.numel()), host=host)

    def stage_in(self, segment: Any, device: int, stream: FakeStream) -> FakeTensor:
        self.copies += 1
        stream.items.append(FakeWork(f"copy to device {device} on {stream.name}"))
        return FakeTensor(device, segment)

    def identity(self) -> GpuIdentity:
        return self._identity

    def export_block(self, device: int, nbytes: int) -> tuple[FakeTensor, tuple[Any, ...]]:
        ipc = self.ipc
        handle = next(ipc._ids)
        block = FakeTensor(device, None, nbytes=nbytes, handle=handle)
        ipc.shared[handle] = _Shared(id(self), self._identity.uuids[device])
        weakref.finalize(block, ipc._let_go, handle)  # torch: the block's deleter
        return block, (self._identity.uuids[device], handle)

    def fill_block(
        self, block: FakeTensor, tensor: Any, nbytes: int, stream: FakeStream
    ) -> FakeEvent:
        if getattr(tensor, "opened", False):
            raise RuntimeError("memory the driver will not share")
        ipc = self.ipc
        handle = block.handle
        assert handle is not None, "not an exported block"
        work = FakeWork(f"fill block {handle} on {stream.name}")
        # The bytes as the producer's work leaves them: what the consumer sees, whatever
        # is written to ``tensor`` later. In shared memory only once the fill has run.
        value = getattr(tensor, "value", None)

        def land() -> None:
            ipc.shared[handle].value = value

        work.action = land
        block.value = value
        self.copies += 1
        stream.items.append(work)
        return self.record(stream)

    def open_block(self, desc: tuple[Any, ...]) -> tuple[int, FakeMapping]:
        uuid, handle = desc
        entry = self.ipc.shared.get(handle)
        local = self._identity.index_of(uuid)
        if self.ipc.refuse or entry is None or local is None:
            raise OSError(f"cannot open shared memory {desc!r}")
        if entry.owner == id(self):
            raise OSError("a process cannot open its own CUDA IPC handle")
        entry.refs += 1
        self.ipc.opened += 1
        return local, FakeMapping(handle, entry)

    def copy_from_block(
        self, opened: FakeMapping, local: int, nbytes: int, device: int, stream: FakeStream
    ) -> tuple[FakeTensor, FakeEvent]:
        if local != device:
            stream.items.append(FakeWork(f"peer copy {local} -> {device} on {stream.name}"))
        self.copies += 1
        stream.items.append(FakeWork(f"copy out of block {opened.handle} on {stream.name}"))
        # What the block holds now: the message's bytes only if the producer's fill has
        # run (its send gate's job).
        tensor = FakeTensor(device, opened.entry.value, nbytes=nbytes)
        return tensor, self.record(stream)

    def close_blocks(self, opened: list[FakeMapping]) -> None:
        for mapping in opened:
            self.ipc.drop(mapping.handle)
        opened.clear()

    def unshare(self, desc: tuple[Any, ...]) -> None:
        self.ipc.drop(desc[1])

    def collect(self) -> None:
        ipc = self.ipc
        for handle in [
            h for h, e in ipc.shared.items() if e.dropped and e.refs <= 0 and e.owner == id(self)
        ]:
            del ipc.shared[handle]
            ipc.freed += 1

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
        for item in stream.pending():
            if items is not None and completed >= items:
                break
            if item.after is not None and not item.after.done():
                break
            item.done = True
            if item.action is not None:
                action, item.action = item.action, None  # what it held is let go, as on a GPU
                action()
            completed += 1
        return completed
