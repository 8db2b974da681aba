"""The streams a callee runs a request on: torch's rule 2 above the device seam (layer L2.45).

A request that carries CUDA tensors (or whose caller maps devices of this worker) leases
one stream per involved device from the agent's ``StreamPool``. Before the function runs,
those streams wait for the request's incoming events (its tensors' copies); the function
runs with them current; the reply's producer events are recorded on them when the reply is
pickled (so an ``async_execution`` result counts the work done until its future
completed); the lease goes back once the reply's frame has left, or when the request fails
or is cancelled.

Current streams are per thread (torch's and the fake's alike). A synchronous function runs
on one pool thread: the streams are made current around the call. An ``async def`` runs on
the loop among other tasks: its streams are made current around each *step* of its
coroutine only (``on_streams``), so a task that runs between two of its steps never sees
them, and the loop thread's own current streams are restored after every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import types
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any

from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.runtime.cuda.devices import CudaStream, Devices
from asyncrpc.runtime.cuda.pool import StreamLease, StreamPool, StreamPoolExhaustedError
from asyncrpc.runtime.net.links import FrameInParts

__all__ = ["POOL_STREAMS", "POOL_TIMEOUT_S", "CalleeStreams", "RequestStreams", "on_streams"]

# Defaults of the callee's stream pool, per device (those of RpcBackendOptions'
# cuda_stream_pool_size and cuda_stream_pool_timeout; a test keeps them equal). torch keeps
# 32 streams per device and priority and shares them round-robin; ours are leased one
# request at a time, so 32 lets 32 requests per device run at once before one waits. A
# request waits its turn at most POOL_TIMEOUT_S, then fails with StreamPoolExhaustedError
# (the caller gets it, typed).
POOL_STREAMS = 32
POOL_TIMEOUT_S = 30.0


class CalleeStreams:
    """One agent's callee streams: its pool, and the loop the pool's waiters wait on."""

    def __init__(self, devices: Devices, pool: StreamPool) -> None:
        self.devices = devices
        self.pool = pool
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the first request served

    @classmethod
    def from_options(cls, devices: Devices, options: RpcBackendOptions) -> CalleeStreams:
        """Sized by ``options.cuda_stream_pool_size`` streams per device and
        ``options.cuda_stream_pool_timeout`` (``RpcBackendOptions`` checked both at init)."""
        pool = StreamPool(devices, options.cuda_stream_pool_size, options.cuda_stream_pool_timeout)
        return cls(devices, pool)

    def request(
        self,
        involved: Sequence[int],
        first: Callable[[], None] | None,
        reply_streams: dict[int, CudaStream] | None,
    ) -> RequestStreams:
        """The streams of one request (called on the loop, after its payload is unpickled).

        Args:
            involved: the devices it leases a stream of.
            first: what orders the current streams after the request's tensors (None:
                nothing to wait for).
            reply_streams: the reply policy's table of producer streams, filled with the
                leased streams (None: the reply carries no CUDA tensors).
        """
        if self.loop is None:
            with contextlib.suppress(RuntimeError):  # unit tests drive hooks with no loop
                self.loop = asyncio.get_running_loop()
        return RequestStreams(self, tuple(involved), first, reply_streams)


class RequestStreams:
    """One request's lease, from just before its function runs until its reply has left.

    Released exactly once: by ``leave`` after the reply's frame waited its turn, by
    ``replied`` for an error or a ``remote()`` value (no reply frame follows), by the
    wrapper when the function raises or is cancelled, and, as a safety net, when this
    object is collected with its lease still held (a request dropped unannounced, e.g.
    cancelled after its function returned).
    """

    __slots__ = ("__weakref__", "_finalizer", "_first", "_reply", "callee", "involved", "lease")

    def __init__(
        self,
        callee: CalleeStreams,
        involved: tuple[int, ...],
        first: Callable[[], None] | None,
        reply: dict[int, CudaStream] | None,
    ) -> None:
        self.callee = callee
        self.involved = involved
        self._first = first
        self._reply = reply
        self.lease: StreamLease | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- running ---------------------------------------------------------------------------

    def wrap(
        self,
        fn: Callable[..., Any],
        coroutine: bool,
        made: Callable[[Any, list[CudaStream]], None] | None = None,
    ) -> Callable[..., Any]:
        """``fn`` run on the leased streams (a coroutine function stays one); ``made``
        is told its result and those streams, before anyone else sees the result (a
        remote() value, kept here and sent later from other streams)."""
        if coroutine:

            async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
                lease = await self._lease_on_loop()
                try:
                    streams = self._leased(lease)
                    with self.callee.devices.use_streams(streams):
                        self._order()
                    result = await on_streams(self.callee.devices, streams, fn(*args, **kwargs))
                except BaseException:
                    self.release()
                    raise
                if made is not None:
                    made(result, streams)
                return result

            return run_coroutine

        def run(*args: Any, **kwargs: Any) -> Any:
            lease = self._lease_blocking()
            try:
                streams = self._leased(lease)
                with self.callee.devices.use_streams(streams):
                    self._order()
                    result = fn(*args, **kwargs)
            except BaseException:
                self.release()
                raise
            if made is not None:
                made(result, streams)
            if inspect.isgenerator(result) or inspect.isasyncgen(result):
                # A stream's producer: its body runs later, item by item, not on these
                # streams, and no reply frame follows: nothing to hold them for.
                self.release()
            return result

        return run

    def _order(self) -> None:
        first, self._first = self._first, None  # once; it holds the received tensors
        if first is not None:
            first()  # the current streams (the leased ones) wait for the request's data

    def _leased(self, lease: StreamLease) -> list[CudaStream]:
        self.lease = lease
        pool = self.callee.pool
        self._finalizer = weakref.finalize(self, pool.release, lease)
        self._finalizer.atexit = False
        streams = list(lease.streams)
        if self._reply is not None:  # the reply's producer events go on these streams
            self._reply.update(zip(lease.devices, streams, strict=True))
        return streams

    async def _lease_on_loop(self) -> StreamLease:
        pool = self.callee.pool
        lease = pool.try_acquire(self.involved)
        return lease if lease is not None else await pool.acquire(self.involved)

    def _lease_blocking(self) -> StreamLease:
        """On a pool thread: wait (bounded by the pool's timeout) for the loop to hand a
        lease over. On the loop itself (an ``@inline`` function) nothing may wait: a pool
        with no stream free fails the request at once."""
        pool = self.callee.pool
        lease = pool.try_acquire(self.involved)
        if lease is not None:
            return lease
        loop = self.callee.loop
        if loop is None or _on(loop):
            raise StreamPoolExhaustedError(self._busiest(), pool.per_device, 0.0)
        waiting = asyncio.run_coroutine_threadsafe(pool.acquire(self.involved), loop)
        try:
            return waiting.result(pool.timeout + 1.0)  # the pool's own timeout comes first
        except concurrent.futures.TimeoutError:  # the loop stopped: nobody hands one over
            waiting.cancel()
            raise StreamPoolExhaustedError(self._busiest(), pool.per_device, pool.timeout) from None

    def _busiest(self) -> int:
        pool = self.callee.pool
        return max(self.involved, key=pool.in_use)

    # -- replying --------------------------------------------------------------------------

    def replied(self, ok: bool, remote: bool) -> None:
        """The reply is pickled (any thread): an error or a remote() value has no frame to
        wait for, so the lease goes back now; a reply's goes back in ``leave``."""
        if not ok or remote:
            self.release()

    def leave(self, ready: Awaitable[None] | None) -> Awaitable[None] | None:
        """What the reply's frame waits for (on the loop): ``ready``, then the lease goes
        back. With nothing to wait for it goes back now (the frame is written next)."""
        if ready is None:
            self.release()
            return None
        if isinstance(ready, FrameInParts):  # keep the reply's parts: its last one releases
            return _ReleasingParts(ready, self.release)
        return self._release_after(ready)

    async def _release_after(self, ready: Awaitable[None]) -> None:
        try:
            await ready
        finally:
            self.release()

    def release(self) -> None:
        """Give the lease back (once; nothing if none was taken). Any thread."""
        finalizer = self._finalizer
        if finalizer is not None:
            finalizer()  # runs pool.release once, and never again at collection


class _ReleasingParts:
    """A reply's parts (``FrameInParts``) that give the request's stream lease back once
    the last part was yielded (its copies are done) or the writer stopped."""

    __slots__ = ("_inner", "_release")

    def __init__(self, inner: FrameInParts, release: Callable[[], None]) -> None:
        self._inner, self._release = inner, release

    async def parts(self, pieces: list[Any]) -> AsyncIterator[list[Any]]:
        inner = self._inner.parts(pieces)
        try:
            async for part in inner:
                yield part
        finally:
            self._release()

    def __await__(self) -> Generator[Any, None, None]:
        try:
            yield from self._inner.__await__()
        finally:
            self._release()


@types.coroutine
def on_streams(
    devices: Devices, streams: list[CudaStream], coro: Coroutine[Any, Any, Any]
) -> Generator[Any, Any, Any]:
    """Drive ``coro`` with ``streams`` current on the loop's thread during each of its steps
    only (between steps other tasks run on the loop with its own current streams)."""
    value: Any = None
    error: BaseException | None = None
    while True:  # one turn per step of the coroutine; it ends when the coroutine does
        with devices.use_streams(streams):
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
        try:
            value, error = (yield step), None
        except GeneratorExit:
            with devices.use_streams(streams):
                coro.close()
            raise
        except BaseException as exc:  # cancellation too: thrown into the coroutine
            value, error = None, exc


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
