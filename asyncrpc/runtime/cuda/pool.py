"""Streams a callee runs on: a bounded pool per device, leased one request at a time
(layer L2). torch's rule 2: a request's function runs with pool streams made current, and
those streams wait for the request's events first, so its kernels cannot read early; a
lease keeps two concurrent requests off one stream. Streams are made lazily up to
``per_device``; when all are leased, a request waits its turn (in order) up to ``timeout``
and then fails with ``StreamPoolExhaustedError`` rather than waiting forever.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrpc.errors import AsyncRpcError
from asyncrpc.runtime.cuda.devices import Devices, Stream

__all__ = ["StreamLease", "StreamPool", "StreamPoolExhaustedError"]


class StreamPoolExhaustedError(AsyncRpcError, TimeoutError):
    """Every pool stream of a device stayed leased for longer than the pool's timeout."""

    def __init__(self, device: int, size: int, timeout: float) -> None:
        super().__init__(
            f"all {size} pool streams of cuda:{device} stayed in use for {timeout:g} s"
        )
        self.device, self.size, self.timeout = device, size, timeout

    def __reduce__(self) -> tuple[type, tuple[int, int, float]]:
        return type(self), (self.device, self.size, self.timeout)


@dataclass(eq=False)
class StreamLease:
    """One stream per device, for one request; give it back with ``StreamPool.release``."""

    streams: tuple[Stream, ...]
    devices: tuple[int, ...]
    released: bool = field(default=False)


class StreamPool:
    def __init__(self, devices: Devices, per_device: int = 8, timeout: float = 30.0) -> None:
        if per_device < 1:
            raise ValueError(f"per_device must be >= 1, got {per_device}")
        self._devices = devices
        self.per_device = per_device
        self.timeout = timeout
        self._free: dict[int, list[Stream]] = {}
        self._made: dict[int, int] = {}
        self._waiters: dict[int, deque[asyncio.Future[Stream]]] = {}

    def in_use(self, device: int) -> int:
        return self._made.get(device, 0) - len(self._free.get(device, []))

    async def acquire(self, devices: Sequence[int]) -> StreamLease:
        """A stream of each of ``devices`` (distinct, taken in ascending order so two
        requests needing the same devices cannot each hold one the other waits for).

        Raises:
            StreamPoolExhaustedError: a device's streams stayed leased past the timeout
                (the streams taken so far are given back first).
        """
        order = sorted(set(devices))
        deadline = time.monotonic() + self.timeout
        taken: list[Stream] = []
        try:
            for device in order:
                taken.append(await self._take(device, deadline))
        except BaseException:
            self._give_back(order[: len(taken)], taken)
            raise
        return StreamLease(tuple(taken), tuple(order))

    def release(self, lease: StreamLease) -> None:
        if lease.released:
            return
        lease.released = True
        self._give_back(list(lease.devices), list(lease.streams))

    async def _take(self, device: int, deadline: float) -> Stream:
        free = self._free.setdefault(device, [])
        waiters = self._waiters.setdefault(device, deque())
        if free and not waiters:
            return free.pop()
        if self._made.get(device, 0) < self.per_device:
            self._made[device] = self._made.get(device, 0) + 1
            return self._devices.new_stream(device)
        waiter: asyncio.Future[Stream] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # Handed a stream in the same turn as giving up: pass it on, never lose it.
                self._give_back([device], [waiter.result()])
            if isinstance(exc, TimeoutError):
                raise StreamPoolExhaustedError(device, self.per_device, self.timeout) from None
            raise
        finally:
            if waiter in waiters:
                waiters.remove(waiter)

    def _give_back(self, devices: list[int], streams: list[Stream]) -> None:
        for device, stream in zip(devices, streams, strict=True):
            waiters = self._waiters.get(device)
            while waiters:  # bounded by the queue: hand it to the first one still waiting
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(stream)
                    break
            else:
                self._free.setdefault(device, []).append(stream)
