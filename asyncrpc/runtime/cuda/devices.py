"""The device seam (layer L2.45): every CUDA call of the runtime's CUDA path goes through
``Devices``, so what sits above it (which events a frame waits for, when it may leave,
which streams a callee runs on, when a caller's streams wait) runs on ``FakeDevices`` in CI
and on ``CudaDevices`` on a GPU, unchanged.

Streams and events are opaque handles to the code above the seam: it only passes them
back to the same ``Devices``. Devices are CUDA indices (``int``); a CPU tensor has none.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["CudaStream", "Devices", "Event", "GpuIdentity", "IpcDescriptor", "devices_of"]

CudaStream = Any  # a device's stream, as the Devices that made it knows it
Event = Any  # a recorded event, likewise
# What names shared device memory to another process on this host: a tuple of ints, bytes,
# str and bools (msgpack-able), its first item the UUID of the GPU the memory is on.
IpcDescriptor = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What two peers compare to decide they share GPUs: the boot they run under and each
    visible device's UUID, in this process's index order (``CUDA_VISIBLE_DEVICES``
    renumbers devices per process, so indices alone say nothing across processes)."""

    boot_id: str
    uuids: tuple[str, ...]

    def index_of(self, uuid: str) -> int | None:
        """This process's index of the device with ``uuid``, or None if it cannot see it."""
        return self.uuids.index(uuid) if uuid in self.uuids else None


class Devices(Protocol):
    """What the CUDA path needs of the devices, and nothing more."""

    def device_of(self, tensor: Any) -> int | None:
        """The CUDA device index of ``tensor``, or None for a tensor not on a GPU."""
        ...

    def current_stream(self, device: int) -> CudaStream:
        """The calling thread's current stream on ``device``."""
        ...

    def new_stream(self, device: int) -> CudaStream:
        """A new stream on ``device`` (pools build theirs from these)."""
        ...

    def use_streams(self, streams: list[CudaStream]) -> AbstractContextManager[None]:
        """Make ``streams`` (at most one per device) the calling thread's current ones for
        the duration of the ``with`` block, then restore the previous ones."""
        ...

    def record(self, stream: CudaStream) -> Event:
        """An event completing once the work queued on ``stream`` so far is done."""
        ...

    def done(self, event: Event) -> bool:
        """Whether ``event`` has completed (never blocks)."""
        ...

    def wait(self, stream: CudaStream, event: Event) -> None:
        """Make work queued on ``stream`` from now on wait for ``event`` (the host does
        not wait)."""
        ...

    def keep(self, tensor: Any, stream: CudaStream) -> None:
        """Keep ``tensor``'s memory from reuse, once it is freed, until the work queued on
        ``stream`` by then is done (a tensor made on one stream and read on another)."""
        ...

    def host_buffer(self, nbytes: int) -> Any:
        """A uint8 CPU tensor of ``nbytes`` in pinned memory (what a received segment bound
        for a GPU lands in, so its copy to the device needs no host wait)."""
        ...

    def stage_out(self, tensor: Any, stream: CudaStream) -> Any:
        """Queue on ``stream`` a copy of ``tensor`` into pinned host memory and return
        that host tensor (same shape and dtype). Its bytes are valid once an event
        recorded on ``stream`` afterwards has completed; ``tensor``'s memory is kept from
        reuse until then. The host does not wait."""
        ...

    def contiguous_nbytes(self, tensor: Any) -> int | None:
        """The size in bytes of ``tensor`` if its elements are contiguous in memory (its
        bytes can be copied in ranges), else None."""
        ...

    def copy_out(self, tensor: Any, host: Any, start: int, stop: int, stream: CudaStream) -> None:
        """Queue on ``stream`` a copy of bytes ``[start, stop)`` of the contiguous device
        ``tensor`` into the same bytes of ``host`` (a flat uint8 pinned CPU tensor of its
        size). They are valid once an event recorded on ``stream`` afterwards has
        completed; ``tensor``'s memory is kept from reuse until then. No host wait."""
        ...

    def host_view(self, host: Any, like: Any) -> Any:
        """``host`` (flat uint8 CPU bytes, filled by ``copy_out``) seen as a CPU tensor of
        ``like``'s dtype and shape."""
        ...

    def stage_in(self, segment: Any, device: int, stream: CudaStream) -> Any:
        """Queue on ``stream`` a copy of ``segment`` (host bytes) to ``device`` and return
        the device tensor; work queued on ``stream`` afterwards sees the bytes. The host
        does not wait for the GPU."""
        ...

    def identity(self) -> GpuIdentity:
        """This process's boot id and visible GPUs' UUIDs."""
        ...

    # -- CUDA IPC: blocks shared once, filled per message (see ipc.py) ------------------

    def export_block(self, device: int, nbytes: int) -> tuple[Any, IpcDescriptor]:
        """Allocate ``nbytes`` of memory on ``device`` and export it to other processes on
        this host: the block and what names it to them. Done once per block: a block is
        filled for message after message and stays allocated while the caller holds it
        (and, once dropped, until every opener released it and ``collect`` ran)."""
        ...

    def fill_block(self, block: Any, tensor: Any, nbytes: int, stream: CudaStream) -> Event:
        """Queue on ``stream`` (the producer's) a copy of the first ``nbytes`` of
        ``tensor``'s memory into ``block``; returns an event recorded after it (of this
        process: the message naming the block leaves once it completed, so the opener
        needs no interprocess event to wait on). The host does not wait; writes to
        ``tensor`` queued later never reach the block."""
        ...

    def open_block(self, desc: IpcDescriptor) -> tuple[int, Any]:
        """Map a block another process exported (the consumer, once per block): this
        process's index of the GPU it lives on, and the mapping.

        Raises:
            OSError: this process cannot open it (another host, a GPU it cannot see, its
                own handle, a driver refusal).
        """
        ...

    def copy_from_block(
        self, opened: Any, local: int, nbytes: int, device: int, stream: CudaStream
    ) -> tuple[Any, Event]:
        """Queue on ``stream`` a copy of the first ``nbytes`` of the mapped block (on GPU
        ``local``; the producer's fill of it had completed before its message was sent)
        into a new flat uint8 tensor on ``device``, owned by this process (a peer copy
        across GPUs). Returns the tensor and an event that completes once the block may be
        filled again. No host wait; work queued on ``stream`` afterwards sees the bytes."""
        ...

    def close_blocks(self, opened: list[Any]) -> None:
        """Unmap these blocks (their producer is gone), emptying the list, which must hold
        the last references. Letting go of a mapping waits for the GPU with the GIL held
        (the whole process stops while the GPU is busy): done only for a lost producer."""
        ...

    def unshare(self, desc: IpcDescriptor) -> None:
        """Drop the reference an opener that died held on an exported block (producer)."""
        ...

    def collect(self) -> None:
        """Free shared memory no opener references any more (producer side)."""
        ...


def devices_of(devices: Devices, tensors: Iterable[Any]) -> list[int]:
    """The distinct CUDA devices of ``tensors``, in first-seen order."""
    seen: dict[int, None] = {}
    for tensor in tensors:
        device = devices.device_of(tensor)
        if device is not None:
            seen.setdefault(device, None)
    return list(seen)
