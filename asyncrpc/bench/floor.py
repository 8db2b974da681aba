"""The raw-socket floor: a uvloop echo of length-prefixed frames with no RPC layer at all.

Part of ``asyncrpc.bench``. This is the best plain-Python way to move the benchmark's bytes
over loopback, so it bounds what any Python RPC layer can reach on the machine: both ends
are ``asyncio.BufferedProtocol`` objects on uvloop that receive straight into one
preallocated, reused buffer; the client drives everything from ``buffer_updated`` (no task or
future per message), and big frames are echoed from the receive buffer without a copy.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any, cast

from asyncrpc.bench.config import FLOOR_CALL_BYTES, MIB, Item
from asyncrpc.bench.stats import (
    echo_stats,
    latency_stats,
    min_echo_iterations,
    throughput_stats,
)

__all__ = ["EchoServer", "FloorClient", "connect", "run_floor_item", "serve"]

_PREFIX = struct.Struct("<Q")
_SLACK = 256 * 1024  # receive-buffer room beyond the largest frame
_NO_COPY_FROM = MIB  # echo frames this big straight from the receive buffer


class _Receiver(asyncio.BufferedProtocol):
    """Receives length-prefixed frames into one reused buffer; subclasses handle them."""

    def __init__(self, capacity: int) -> None:
        self._buf = bytearray(capacity + _SLACK)
        self._view = memoryview(self._buf)
        self._start = 0  # first byte not yet consumed
        self._end = 0  # first free byte
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        start = pos = self._start
        end, buf = self._end, self._buf
        frames = 0
        while end - pos >= 8:
            (length,) = _PREFIX.unpack_from(buf, pos)
            if end - pos - 8 < length:
                break
            pos += 8 + length
            frames += 1
        self._start = pos
        if frames:
            self.frames_received(start, pos, frames)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0 and len(buf) - self._end < _SLACK // 2:
            # Move the partial frame to the front. Big frames always start at 0 (one in
            # flight), so only a few bytes of small frames are ever moved.
            left = self._end - self._start
            buf[:left] = buf[self._start : self._end]
            self._start, self._end = 0, left

    def frames_received(self, start: int, end: int, count: int) -> None:
        raise NotImplementedError


class EchoServer(_Receiver):
    """Writes every complete frame straight back."""

    def frames_received(self, start: int, end: int, count: int) -> None:
        assert self.transport is not None
        if end - start >= _NO_COPY_FROM:
            # One big frame: echo it from the receive buffer. Safe because the client sends
            # its next frame only after this one came back whole, so nothing overwrites it.
            self.transport.write(self._view[start:end])
        else:
            self.transport.write(bytes(self._view[start:end]))


class FloorClient(_Receiver):
    """Sends frames and counts the echoes; one measurement at a time."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._frame = b""
        self._outstanding = 0
        self._done = 0
        self._deadline = 0.0
        self._sent_at = 0
        self._samples: list[int] | None = None
        self._waiter: asyncio.Future[None] | None = None

    def frames_received(self, start: int, end: int, count: int) -> None:
        now = time.perf_counter_ns()
        self._outstanding -= count
        self._done += count
        if self._samples is not None:
            self._samples.append(now - self._sent_at)
        if self._frame and now < self._deadline:
            self._sent_at = now
            assert self.transport is not None
            self.transport.write(self._frame * count if count > 1 else self._frame)
            self._outstanding += count
        elif self._outstanding == 0 and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def calls(self, inflight: int, duration: float, record: bool) -> tuple[int, list[int]]:
        """Keep ``inflight`` small frames in flight for ``duration`` seconds.

        Returns:
            The number of echoes and, when ``record``, every round-trip time in ns.
        """
        assert self.transport is not None
        body = FLOOR_CALL_BYTES - 8
        self._frame = _PREFIX.pack(body) + bytes(body)
        self._samples = [] if record else None
        self._done, self._outstanding = 0, inflight
        self._deadline = time.perf_counter_ns() + duration * 1e9
        self._waiter = asyncio.get_running_loop().create_future()
        self._sent_at = time.perf_counter_ns()
        self.transport.write(self._frame * inflight)
        await self._waiter
        samples, self._samples, self._frame = self._samples or [], None, b""
        return self._done, samples

    async def echo(self, prefix: bytes, payload: memoryview) -> int:
        """Send one big frame and wait for it to come back; return the time in ns."""
        assert self.transport is not None
        self._outstanding, self._deadline = 1, 0.0
        self._waiter = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter_ns()
        self.transport.writelines([prefix, payload])
        await self._waiter
        return time.perf_counter_ns() - t0


async def serve(capacity: int, port: int = 0) -> tuple[asyncio.Server, int]:
    """Listen on 127.0.0.1:``port`` (0: a free one); return the server and its port."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EchoServer(capacity), "127.0.0.1", port)
    return server, int(server.sockets[0].getsockname()[1])


async def connect(port: int, capacity: int, timeout: float = 60.0) -> FloorClient:
    """Connect to the echo server, retrying while it starts; one round trip makes sure it
    has set up its side.

    Raises:
        OSError: no server answered within ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _, client = await loop.create_connection(
                lambda: FloorClient(capacity), "127.0.0.1", port
            )
            break
        except ConnectionRefusedError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)
    await client.calls(1, 0.0, record=False)
    return client


async def _echo_item(
    client: FloorClient, size: int, duration: float, payloads: dict[int, memoryview]
) -> Any:
    if size not in payloads:
        payloads[size] = memoryview(bytearray(size))
    prefix, payload = _PREFIX.pack(size), payloads[size]
    times: list[int] = []
    end = time.perf_counter_ns() + duration * 1e9
    while time.perf_counter_ns() < end or len(times) < min_echo_iterations(size):
        times.append(await client.echo(prefix, payload))
    return echo_stats(size, times)


async def run_floor_item(
    client: FloorClient, item: Item, duration: float, payloads: dict[int, memoryview]
) -> Any:
    """Run one floor item; same statistics as the RPC systems report."""
    if item.kind == "echo":
        return await _echo_item(client, item.size, duration, payloads)
    if item.kind in ("latency", "remote"):
        _, samples = await client.calls(1, duration, record=True)
        return latency_stats(samples)
    start = time.perf_counter()
    done, _ = await client.calls(item.inflight, duration, record=False)
    return throughput_stats(done, time.perf_counter() - start)
