"""``CudaDevices``: the device seam over ``torch.cuda`` (layer L2.45).

Nothing here synchronizes the host: ``record`` and ``wait`` queue work on streams,
``done`` asks an event without blocking. Built only where CUDA is available; its contract
is the one ``FakeDevices`` simulates, checked on hardware by ``tests/gpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrpc.runtime.cuda.devices import GpuIdentity

__all__ = ["CudaDevices", "boot_id"]


def boot_id() -> str:
    """This machine's boot id (Linux), or "" where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


STREAMS_CACHED = 1024  # distinct (device, stream) pairs remembered; past it, start over


class _OnStream:
    """``stream`` current on its device for a block, and the current device and stream
    restored after: what ``torch.cuda.stream`` does, for ~1/10 of its host time (on an
    H100 machine it cost 23 us a use, mostly in building ``Stream`` objects to restore;
    this asks for and restores the raw ids)."""

    __slots__ = ("_device", "_previous", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._device = -1
        self._previous: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        stream = self._stream
        index = stream.device_index
        self._device = torch._C._cuda_getDevice()
        self._previous = torch._C._cuda_getCurrentStream(index)
        # Sets the current device to the stream's too.
        torch._C._cuda_setStream(
            stream_id=stream.stream_id, device_index=index, device_type=stream.device_type
        )

    def __exit__(self, *exc: object) -> None:
        previous = self._previous
        assert previous is not None
        stream_id, index, device_type = previous
        torch._C._cuda_setStream(stream_id=stream_id, device_index=index, device_type=device_type)
        if self._device != index:
            torch._C._cuda_setDevice(self._device)


class CudaDevices:
    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevices needs a CUDA device; use FakeDevices in tests")
        self._opening: dict[int, torch.cuda.Stream] = {}  # where other GPUs' memory opens
        self._idle: dict[int, torch.cuda.Stream] = {}  # never given work: see close_blocks
        # (device, raw stream) -> its Stream: torch builds a new Stream object on every
        # current_stream() (14 us a call on an H100 machine, several per message).
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def device_of(self, tensor: Any) -> int | None:
        if not getattr(tensor, "is_cuda", False):
            return None
        return int(tensor.get_device())

    def current_stream(self, device: int) -> torch.cuda.Stream:
        key = (device, torch._C._cuda_getCurrentRawStream(device))
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= STREAMS_CACHED:  # a program that makes streams anew
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.current_stream(device)
        return stream

    def new_stream(self, device: int) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def use_streams(self, streams: list[torch.cuda.Stream]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for stream in streams:  # sets the current stream of its device
                stack.enter_context(_OnStream(stream))
            yield

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def done(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())  # type: ignore[no-untyped-call]

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def keep(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def stage_out(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        with _OnStream(stream):
            # empty_like keeps a dense tensor's strides; pinned memory lets the copy run
            # without the host (torch's caching host allocator reuses these buffers).
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy ran
        return host

    def contiguous_nbytes(self, tensor: torch.Tensor) -> int | None:
        # Conjugate and negative bits live outside the bytes: those go whole (stage_out's
        # copy_ resolves them).
        if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            return None
        return tensor.numel() * tensor.element_size()

    def copy_out(
        self, tensor: torch.Tensor, host: torch.Tensor, start: int, stop: int,
        stream: torch.cuda.Stream,
    ) -> None:  # fmt: skip
        flat = tensor.detach().reshape(-1).view(torch.uint8)  # contiguous: no copy
        with _OnStream(stream):
            host[start:stop].copy_(flat[start:stop], non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy ran

    def host_view(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return host.view(like.dtype).view(like.shape)

    def stage_in(
        self, segment: torch.Tensor, device: int, stream: torch.cuda.Stream
    ) -> torch.Tensor:
        with _OnStream(stream):
            return segment.to(torch.device("cuda", device), non_blocking=True)

    # -- CUDA IPC: blocks exported once, filled per message (see blocks.py) --------------

    def export_block(self, device: int, nbytes: int) -> tuple[torch.Tensor, tuple[Any, ...]]:
        idle = self._side_stream(device, self._idle)
        with torch.cuda.stream(idle):
            # _share_cuda_ records an interprocess event of its own on the current stream,
            # which the opener waits for once: on a stream with no work it is done at once.
            # Each message gets its own event (fill_block).
            block = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
            index, handle, size, offset, counter, counter_offset, event, sync = (
                block.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            )
        uuid = str(torch.cuda.get_device_properties(int(index)).uuid)
        return block, (uuid, handle, size, offset, counter, counter_offset, event, sync)

    def fill_block(
        self, block: torch.Tensor, tensor: torch.Tensor, nbytes: int, stream: torch.cuda.Stream
    ) -> torch.cuda.Event:
        with _OnStream(stream):
            span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            span.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(),
                      (nbytes,), (1,))  # fmt: skip
            block[:nbytes].copy_(span, non_blocking=True)
        # Read and written on `stream`: neither is reused before the copy ran.
        block.record_stream(stream)
        with contextlib.suppress(RuntimeError):  # memory not from torch's allocator
            tensor.record_stream(stream)
        return self.record(stream)

    def open_block(self, desc: tuple[Any, ...]) -> tuple[int, torch.Tensor]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid, handle, size, offset, counter, counter_offset, event, sync = desc
        local = self.identity().index_of(uuid)
        if local is None:
            raise OSError(f"GPU {uuid} is not visible in this process")
        try:
            with torch.cuda.stream(self._side_stream(local, self._opening)):
                opened: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
                    torch.Tensor, (size,), (1,), 0, torch.UntypedStorage, torch.uint8,
                    local, handle, size, offset, False, counter, counter_offset, event, sync,
                )  # fmt: skip
        except RuntimeError as exc:  # the driver refused (another host, policies, limits)
            raise OSError(f"cannot open CUDA IPC memory: {exc}") from exc
        return local, opened

    def copy_from_block(
        self, opened: torch.Tensor, local: int, nbytes: int, device: int,
        stream: torch.cuda.Stream,
    ) -> tuple[torch.Tensor, torch.cuda.Event]:  # fmt: skip
        # No wait: the producer's fill completed before it sent the message naming the
        # block (its send gate), so every copy queued after the message arrived sees it.
        with _OnStream(stream):
            # Ours: the block is free for the producer's next message once this is done,
            # and the value can be sent on by handle again (an echo's reply). From another
            # GPU of this host: a peer copy.
            copy = torch.empty(nbytes, dtype=torch.uint8, device=device)
            copy.copy_(opened[:nbytes], non_blocking=True)
        return copy, self.record(stream)

    def close_blocks(self, opened: list[torch.Tensor]) -> None:
        for device in {int(t.device.index or 0) for t in opened}:
            with torch.cuda.stream(self._side_stream(device, self._idle)):
                # torch's deleter synchronizes the current stream: one with no work.
                kept = [t for t in opened if int(t.device.index or 0) != device]
                opened[:] = kept
                del kept

    def _side_stream(self, device: int, streams: dict[int, torch.cuda.Stream]) -> torch.cuda.Stream:
        if device not in streams:
            streams[device] = self.new_stream(device)
        return streams[device]

    def unshare(self, desc: tuple[Any, ...]) -> None:
        _, _, _, _, counter, counter_offset, _, _ = desc
        local = self.identity().index_of(desc[0])
        torch.UntypedStorage._release_ipc_counter(  # type: ignore[no-untyped-call]
            counter, counter_offset, device=local
        )

    def collect(self) -> None:
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def identity(self) -> GpuIdentity:
        uuids = tuple(
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        )
        return GpuIdentity(boot_id(), uuids)
