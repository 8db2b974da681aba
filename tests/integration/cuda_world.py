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

CUDA IPC between the processes of one test (``IPC_DIR`` in the environment names a
directory they share; unset, IPC stays off): an exported block is a file there, its fill
writes the tensor's bytes into it once the fill has run (``DELAYS`` of its device later,
as a copy to the host), and the consumer copies out of the file what it holds when it
opens it, so a frame that left before its fill ran would bring zeros. ``IPC_MODE`` is the
``cuda_transfer`` the world acts on ("auto": probed, or "ipc").
"""

from __future__ import annotations

import itertools
import os
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
from asyncrpc.runtime.cuda.ipc import IpcLinks
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
        self._blocks = itertools.count(1)
        self.filled: list[int] = []  # the first byte of each fill of a block, as it ran
        self.copied_out: list[int] = []  # the first byte of each copy out of a block

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

    # -- CUDA IPC between processes (see the module's docstring) ---------------------------

    def export_block(self, device: int, nbytes: int) -> tuple[Any, tuple[Any, ...]]:
        path = os.path.join(os.environ["IPC_DIR"], f"{os.getpid()}-{next(self._blocks)}")
        with open(path, "wb") as block:
            block.truncate(nbytes)
        return path, (self.identity().uuids[device], path)

    def fill_block(self, block: Any, tensor: Any, nbytes: int, stream: FakeStream) -> FakeEvent:
        self.copies += 1
        data = tensor.detach().reshape(-1).view(torch.uint8)[:nbytes].numpy().tobytes()

        def land() -> None:  # in the block only once the fill has run
            with open(block, "r+b") as file:
                file.write(data)
            self.filled.append(data[0] if data else -1)

        work = FakeWork(f"fill block {block}", action=land)
        with self._lock:
            self._due[id(work)] = time.monotonic() + DELAYS[stream.device]
            stream.items.append(work)
        return self.record(stream)

    def open_block(self, desc: tuple[Any, ...]) -> tuple[int, Any]:
        uuid, path = desc
        local = self.identity().index_of(uuid)
        mine = os.path.basename(path).startswith(f"{os.getpid()}-")  # not its own handle
        if local is None or not os.path.exists(path) or mine:
            raise OSError(f"cannot open shared memory {desc!r}")
        return local, path

    def copy_from_block(
        self, opened: Any, local: int, nbytes: int, device: int, stream: FakeStream
    ) -> tuple[Any, FakeEvent]:
        self.copies += 1
        with open(opened, "rb") as file:  # what the block holds now: filled, if sent right
            data = bytearray(file.read(nbytes))
        with self._lock:
            stream.items.append(FakeWork(f"copy out of {opened} on {stream.name}"))
        self.copied_out.append(data[0] if data else -1)
        return on(device, torch.frombuffer(data, dtype=torch.uint8)), self.record(stream)

    def close_blocks(self, opened: list[Any]) -> None:
        opened.clear()

    def unshare(self, desc: tuple[Any, ...]) -> None:
        pass  # files: nothing counts references

    def collect(self) -> None:
        pass


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
    if target.startswith("ipc:"):  # by handle: no bytes travel
        view = memoryview(b"")
    return (*descriptor[:8], target), (view, target), keep


TRANSFERS: list[StagedTransfer] = []  # the agent's, once it joined


def _transfer(options: RpcBackendOptions, same_host: Any = None) -> StagedTransfer:
    transfer = StagedTransfer.from_options(GPU, options)
    mode = os.environ.get("IPC_MODE", "auto")
    if os.environ.get("IPC_DIR") and same_host is not None:
        transfer.ipc = IpcLinks(GPU, same_host, mode == "auto", transfer.in_stream)
    TRANSFERS.append(transfer)
    return transfer


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


MADE: list[int] = []  # the items ``endless`` made, in this process


def endless() -> Iterator[torch.Tensor]:
    """Tensors on fake device 1 (its copies are at once), numbered, until closed."""
    i = 0
    while True:
        MADE.append(i)
        yield on(1, torch.full((NBYTES,), i % 256, dtype=torch.uint8))
        i += 1


def ipc_stats(peer: str) -> dict[str, Any]:
    """This worker's CUDA IPC counters, blocks lent to ``peer``, and ``endless``'s items."""
    import asyncrpc

    ipc = TRANSFERS[-1].ipc if TRANSFERS else None
    if ipc is None:
        return {"made": len(MADE)}
    lent = ipc.outstanding(asyncrpc.get_worker_info(peer).id)
    return {"lent": lent, "made": len(MADE), **ipc.stats()}
