"""A TCP proxy that injects faults between two workers, for tests (layer L4).

Put it in front of a worker by starting the worker with ``listen_port`` = the proxy's
target and ``advertise_port`` = the proxy's port: every other worker then reaches it through
the proxy. The proxy runs its own event loop on a thread; from any thread, set a fault:

- ``delay(seconds)``: hold every chunk that long before forwarding it;
- ``blackhole()``: stop forwarding in both directions, keeping the sockets open (a hung
  host, a dead link): only heartbeats can tell;
- ``drop()``: close every connection through it at once (a reset), and keep refusing;
- ``truncate(after_bytes)``: forward that many more bytes towards the worker, then cut the
  connection in the middle of whatever frame is passing;
- ``heal()``: forward normally again (new connections only, for drop and truncate).

Only 127.0.0.1. Every loop is bounded by the connections' lifetimes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

__all__ = ["FaultProxy"]

_CHUNK = 1 << 16


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``, with faults on demand."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._thread.daemon = True
        self._thread.start()
        self._mode = "pass"
        self._delay = 0.0
        self._budget = 0  # bytes still forwarded towards the worker while truncating
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self._server: asyncio.Server = self._call(self._serve(port))
        self.port: int = self._server.sockets[0].getsockname()[1]

    # -- faults (any thread) ---------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        self._set("delay", seconds)

    def blackhole(self) -> None:
        self._set("blackhole")

    def drop(self) -> None:
        self._set("drop")
        self._call(self._close_all())

    def truncate(self, after_bytes: int) -> None:
        self._budget = after_bytes
        self._set("truncate")

    def heal(self) -> None:
        self._set("pass")

    def close(self) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # -- inside ----------------------------------------------------------------------------

    def _set(self, mode: str, delay: float = 0.0) -> None:
        self._mode, self._delay = mode, delay

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._accept, "127.0.0.1", port)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._mode == "drop":
            client_w.close()
            return
        try:
            worker_r, worker_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        self.connections += 1
        self._writers |= {client_w, worker_w}
        await asyncio.gather(
            self._pump(client_r, worker_w, towards_worker=True),
            self._pump(worker_r, client_w, towards_worker=False),
            return_exceptions=True,
        )
        for writer in (client_w, worker_w):
            self._writers.discard(writer)
            writer.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, towards_worker: bool
    ) -> None:
        while data := await reader.read(_CHUNK):  # ends at EOF or when a side closes
            mode = self._mode
            if mode == "blackhole":
                continue  # swallowed: the sender sees nothing come back
            if mode == "delay":
                await asyncio.sleep(self._delay)
            if mode == "truncate" and towards_worker:
                data = data[: self._budget]
                self._budget -= len(data)
                if self._budget <= 0:
                    writer.write(data)
                    await self._close_all()
                    return
            writer.write(data)
            await writer.drain()

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    async def _shutdown(self) -> None:
        self._server.close()
        await self._close_all()
