"""Streams a callee runs on: a bounded pool per device, leased one request at a time
(layer L2.45). torch's rule 2: a request's function runs with pool streams made current, and
those streams wait for the request's events first, so its kernels cannot read early; a
lease keeps two concurrent requests off one stream. Streams are made lazily up to
``per_device``; when all are leased, a request waits its turn (in order) up to ``timeout``
and then fails with ``StreamPoolExhaustedError`` rather than waiting forever.

Threads: ``acquire`` runs on the loop; ``try_acquire`` (never waits) and ``release`` may be
called from any thread (a callee's pool thread): the free lists sit behind a lock, and a
release off the loop hands its streams to waiters through their loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrpc.errors import AsyncRpcError
from asyncrpc.runtime.cuda.devices import CudaStream, Devices

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

    streams: tuple[CudaStream, ...]
    devices: tuple[int, ...]
    released: bool = field(default=False)


class StreamPool:
    def __init__(self, devices: Devices, per_device: int = 8, timeout: float = 30.0) -> None:
        if per_device < 1:
            raise ValueError(f"per_device must be >= 1, got {per_device}")
        self._devices = devices
        self.per_device = per_device
        self.timeout = timeout
        self._free: dict[int, list[CudaStream]] = {}
        self._made: dict[int, int] = {}
        self._waiters: dict[int, deque[asyncio.Future[CudaStream]]] = {}
        self._lock = threading.Lock()  # the three tables above, for try_acquire off the loop
        self.leased = 0  # leases handed out, and given back (for tests and metrics)
        self.released = 0

    def in_use(self, device: int) -> int:
        return self._made.get(device, 0) - len(self._free.get(device, []))

    def try_acquire(self, devices: Sequence[int]) -> StreamLease | None:
        """A stream of each of ``devices`` if every one is free (or can still be made) and
        nobody waits for one, else None; never waits. Safe from any thread."""
        order = sorted(set(devices))
        taken: list[CudaStream] = []
        with self._lock:
            for device in order:
                stream = self._take_now(device)
                if stream is None:
                    for back, got in zip(order, taken, strict=False):
                        self._free.setdefault(back, []).append(got)  # nobody waits for them
                    return None
                taken.append(stream)
            self.leased += 1
        return StreamLease(tuple(taken), tuple(order))

    async def acquire(self, devices: Sequence[int]) -> StreamLease:
        """A stream of each of ``devices`` (distinct, taken in ascending order so two
        requests needing the same devices cannot each hold one the other waits for).

        Raises:
            StreamPoolExhaustedError: a device's streams stayed leased past the timeout
                (the streams taken so far are given back first).
        """
        order = sorted(set(devices))
        deadline = time.monotonic() + self.timeout
        taken: list[CudaStream] = []
        try:
            for device in order:
                taken.append(await self._take(device, deadline))
        except BaseException:
            self._give_back(order[: len(taken)], taken)
            raise
        with self._lock:
            self.leased += 1
        return StreamLease(tuple(taken), tuple(order))

    def release(self, lease: StreamLease) -> None:
        """Give ``lease``'s streams back (once; later calls do nothing). Any thread."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            self.released += 1
        self._give_back(list(lease.devices), list(lease.streams))

    def _take_now(self, device: int) -> CudaStream | None:
        # Under the lock: a free stream, or a new one below the bound, unless others wait.
        free = self._free.setdefault(device, [])
        if self._waiters.get(device):
            return None
        if free:
            return free.pop()
        if self._made.get(device, 0) < self.per_device:
            self._made[device] = self._made.get(device, 0) + 1
            return self._devices.new_stream(device)
        return None

    async def _take(self, device: int, deadline: float) -> CudaStream:
        waiter: asyncio.Future[CudaStream] = asyncio.get_running_loop().create_future()
        with self._lock:
            stream = self._take_now(device)
            if stream is not None:
                return stream
            waiters = self._waiters.setdefault(device, deque())
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
            with self._lock:
                if waiter in waiters:
                    waiters.remove(waiter)

    def _give_back(self, devices: list[int], streams: list[CudaStream]) -> None:
        # On the loop (or with no loop ever waited on): waiters' futures are set here.
        for device, stream in zip(devices, streams, strict=True):
            with self._lock:
                waiters = self._waiters.get(device)
                handed = None
                while waiters:  # bounded by the queue: the first one still waiting gets it
                    waiter = waiters.popleft()
                    if not waiter.done():
                        handed = waiter
                        break
                if handed is None:
                    self._free.setdefault(device, []).append(stream)
            if handed is None:
                continue
            loop = handed.get_loop()
            if _running(loop):
                handed.set_result(stream)
            else:  # a release off the loop: the waiter's future is the loop's to set
                try:
                    loop.call_soon_threadsafe(self._hand, device, handed, stream)
                except RuntimeError:  # its loop is closed: nobody waits any more
                    with self._lock:
                        self._free.setdefault(device, []).append(stream)

    def _hand(self, device: int, waiter: asyncio.Future[CudaStream], stream: CudaStream) -> None:
        if waiter.done():  # it gave up meanwhile: the next one gets it
            self._give_back([device], [stream])
        else:
            waiter.set_result(stream)


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread is running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
