"""``CudaDevices``: the device seam over ``torch.cuda`` (layer L2).

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


class CudaDevices:
    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevices needs a CUDA device; use FakeDevices in tests")

    def device_of(self, tensor: Any) -> int | None:
        device = getattr(tensor, "device", None)
        if device is None or device.type != "cuda":
            return None
        index = device.index
        return int(index) if index is not None else torch.cuda.current_device()

    def current_stream(self, device: int) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: int) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def use_streams(self, streams: list[torch.cuda.Stream]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for stream in streams:  # torch.cuda.stream sets the current stream of its device
                stack.enter_context(torch.cuda.stream(stream))
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
        with torch.cuda.stream(stream):
            # empty_like keeps a dense tensor's strides; pinned memory lets the copy run
            # without the host (torch's caching host allocator reuses these buffers).
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy ran
        return host

    def stage_in(
        self, segment: torch.Tensor, device: int, stream: torch.cuda.Stream
    ) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return segment.to(torch.device("cuda", device), non_blocking=True)

    def identity(self) -> GpuIdentity:
        uuids = tuple(
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        )
        return GpuIdentity(boot_id(), uuids)
