"""A fake CUDA world for worker processes, and the stream functions run in it (test layer).

``install()`` (called by the scenario before it joins; a worker imports
``tests.integration.cuda_world_on`` first, which calls it) puts the process in a world of
``GPU``, ``FakeDevices`` that run without a GPU. Importing this module changes nothing: the
pytest process and the other scenarios import it (for its names) and keep the real world.

- a "CUDA tensor" is a CPU tensor marked with ``fake_device``: the agent's transfer is a
  ``StagedTransfer`` over ``GPU``, and the serializer sends a marked tensor through the
  tensor policy (``to_host``) as it sends a tensor that is not in CPU memory;
- the GPU runs by itself, as far as the send gate's polls ask: a copy to the host on
  device ``d`` completes ``DELAYS[d]`` seconds after it was queued (device 0 slow, device
  1 at once) and lands its bytes only then (a frame that left early would carry zeros);
  the rest runs once what it waits for has.

What each side saw is asked of it with ``observed``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

import asyncrpc.runtime.agent as agent_module
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.serde import pickler
from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy
from asyncrpc.runtime.cuda import FakeDevices, feature
from asyncrpc.runtime.cuda.fake import FakeEvent, FakeStream, FakeWork
from asyncrpc.runtime.cuda.maps import check_device_maps
from asyncrpc.runtime.cuda.staging import StagedTransfer

DELAYS = {0: 1.0, 1: 0.0}  # seconds a copy to the host takes on each device
NBYTES = 64 << 10  # large enough to travel as a segment


class WireGpu(FakeDevices):
    """``FakeDevices`` whose tensors are marked CPU tensors (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(2)
        self._due: dict[int, float] = {}  # id(copy) -> when it completes
        self._lock = threading.Lock()
        self.landed: list[int] = []  # the first byte of each copy to the host, as it ran
        self.arrived: list[int] = []  # the device of each segment copied in

    def done(self, event: FakeEvent) -> bool:
        with self._lock:
            return self._advanced(event)

    def _advanced(self, event: FakeEvent) -> bool:
        # Run the event's stream as far as it may go: a wait goes once its event's own
        # stream got that far (advanced in turn), a copy once its time has come.
        for item in event.stream.pending():
            if item.after is not None and not self._advanced(item.after):
                break
            if self._due.get(id(item), 0.0) > time.monotonic():
                break
            item.done = True
            if item.action is not None:
                action, item.action = item.action, None
                action()
        return event.done()

    def copy_out(self, tensor: Any, host: Any, start: int, stop: int, stream: FakeStream) -> None:
        self.copies += 1
        source = tensor.detach().reshape(-1).view(torch.uint8)[start:stop].clone()

        def land() -> None:  # the bytes reach host memory only once the copy has run
            host[start:stop] = source
            self.landed.append(int(source[0]))

        work = FakeWork(f"copy {start}:{stop} to host", action=land)
        with self._lock:
            self._due[id(work)] = time.monotonic() + DELAYS[stream.device]
            stream.items.append(work)

    def host_view(self, host: Any, like: Any) -> Any:
        return host.view(like.dtype).view(like.shape)

    def stage_in(self, segment: Any, device: int, stream: FakeStream) -> Any:
        self.copies += 1
        with self._lock:
            stream.items.append(FakeWork(f"copy to device {device} on {stream.name}"))
        self.arrived.append(device)
        return on(device, segment.clone())


GPU = WireGpu()


def on(device: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, marked as living on fake CUDA device ``device``."""
    tensor.fake_device = device  # type: ignore[attr-defined]
    return tensor


# -- installed in the process -----------------------------------------------------------------

_export = pickler.export_tensor


def _export_marked(tensor: torch.Tensor, key: int, policy: TensorPolicy = DEFAULT) -> Any:
    # As export_tensor does for a tensor not in CPU memory: the policy brings it to the
    # host and names the receiver's device.
    if getattr(tensor, "fake_device", None) is None:
        return _export(tensor, key, policy)
    target, host = policy.to_host(tensor)
    descriptor, (view, _), keep = _export(host, key, DEFAULT)
    return (*descriptor[:8], target), (view, target), keep


def _transfer(options: RpcBackendOptions, same_host: Any = None) -> StagedTransfer:
    return StagedTransfer.from_options(GPU, options)


def _check(name: str, maps: Any, devices: Any, count: int) -> None:
    check_device_maps(name, maps, devices, GPU.count)


def install() -> None:
    """Put this process in the fake CUDA world (before it joins a group)."""
    pickler.export_tensor = _export_marked  # type: ignore[assignment]
    feature.cuda_transfer = _transfer  # type: ignore[assignment]
    agent_module.check_device_maps = _check  # type: ignore[assignment]


# -- what the group runs ----------------------------------------------------------------------


def items(n: int) -> Iterator[torch.Tensor]:
    """``n`` tensors, item ``i`` filled with ``i`` on fake device ``i % 2``."""
    for i in range(n):
        yield on(i % 2, torch.full((NBYTES,), i, dtype=torch.uint8))


def read(source: Any) -> dict[str, Any]:
    """Read a stream of tensors on a stream of this thread's own; what it saw."""
    mine = [GPU.new_stream(0), GPU.new_stream(1)]
    seen = []
    with GPU.use_streams(mine):
        for tensor in source:
            seen.append(_describe(tensor))
    return {"items": seen, "waits": [len(s.items) for s in mine]}


def echo(requests: Any) -> Iterator[torch.Tensor]:
    """Each request tensor back, doubled, on fake device 0 (a bidirectional stream)."""
    for tensor in requests:
        yield on(0, tensor * 2)


def _describe(tensor: torch.Tensor) -> list[Any]:
    """What a received tensor holds: its first byte, whether all bytes are that one (a
    frame that left before its copy ran would bring zeros), and its size."""
    first = int(tensor[0])
    return [first, bool((tensor == first).all()), tensor.numel()]


def observed() -> dict[str, Any]:
    """What this process's fake GPU saw."""
    return {"landed": list(GPU.landed), "arrived": list(GPU.arrived)}
