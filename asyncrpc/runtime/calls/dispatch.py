"""Runs received requests and sends their replies (layer L2, on the agent's loop).

``async def`` functions run as tasks on the loop; synchronous ones run on the agent's
``WorkerPool`` so a blocking function never stalls the loop, and the pool thread also
pickles the result and builds the reply frame; ``@inline`` ones run on the loop.
``async_execution`` functions reply when the future they return completes. Every request
can be cancelled by the caller (timeout or cancellation): a task is cancelled, a pool job
that has not started is dropped. Requests that carry pipeline header fields (or every
request, while a hook serves all) pass through the call pipeline's callee side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

from asyncrpc.errors import (
    AsyncExecutionError,
    ClosedError,
    FrameTooLargeError,
    FunctionNotFoundError,
    SerializationError,
    ThreadPoolExhaustedError,
)
from asyncrpc.functions import is_async_execution, is_coroutine_function, is_inline
from asyncrpc.protocol.serde import MissingReferenceError, Serializer, pack_exception
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import CallMode, ErrorReply, Reply, Request
from asyncrpc.runtime.calls.builtins import checked_op, is_torch_c_function, runs_on_loop
from asyncrpc.runtime.calls.pipeline import IncomingCall, Pipeline
from asyncrpc.runtime.future import Future
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.services import RRefService
from asyncrpc.runtime.threadpool import Job as PoolJob
from asyncrpc.runtime.threadpool import WorkerPool

__all__ = ["Dispatcher", "await_async_result"]

_log = logging.getLogger("asyncrpc.runtime.calls.dispatch")
# What a built reply keeps alive while it is written, and the RRef forks it carries.
_Keep = tuple[object, Any]

# What runs a request: a task on the loop or a job in the pool (for cancellation).
Job = asyncio.Task[Any] | PoolJob


class Connection(Protocol):
    """The side of a connection the dispatcher needs: who sent the request."""

    peer: int | None
    peer_name: str | None


# Writes a frame on a connection (the agent's; a closed connection drops it).
Writer = Callable[[Any, list[Any], object, Any], None]


async def await_async_result(result: Any) -> Any:
    """Await whatever an ``async_execution`` function returned, on the agent's loop."""
    if isinstance(result, Future):
        return await result
    if asyncio.isfuture(result) or asyncio.iscoroutine(result):
        return await result
    if isinstance(result, concurrent.futures.Future):
        return await asyncio.wrap_future(result)
    import torch

    if isinstance(result, torch.futures.Future):
        return await Future.from_torch(result)
    raise AsyncExecutionError(
        f"an @async_execution function must return a future or a coroutine, got "
        f"{type(result).__name__} (Functions decorated with @rpc.async_function must return "
        "a torch.futures.Future object, or with asyncrpc a coroutine)"
    )


def _is_future_like(value: Any) -> bool:
    return (
        isinstance(value, Future | concurrent.futures.Future)
        or asyncio.isfuture(value)
        or asyncio.iscoroutine(value)
        or type(value).__name__ == "Future"  # torch.futures.Future, without importing torch
    )


class Dispatcher:
    """Executes requests for one agent."""

    def __init__(
        self,
        name: str,
        loop: asyncio.AbstractEventLoop,
        pool: WorkerPool,
        serializer: Serializer,
        write: Writer,
        reply_device_map: Callable[[int], Mapping[str, str] | None],
        counters: Counters,
        pipeline: Pipeline,
        rrefs: RRefService,
        print_errors: bool = True,
    ) -> None:
        self._name = name
        self._print_errors = print_errors
        self._loop = loop
        self._pool = pool
        self._serializer = serializer
        self._write = write
        self._reply_device_map = reply_device_map
        self._counters = counters
        self._pipeline = pipeline
        self._jobs: dict[tuple[int, int], Job] = {}
        # The connection each call (not remote()) came on: when it drops, nobody is left
        # to read the reply, so the call is cancelled (remote() values must still land).
        self._came_on: dict[tuple[int, int], Connection] = {}
        # Requests going through the pipeline, until their reply is built.
        self._served: dict[tuple[int, int], IncomingCall] = {}
        # Keeps the values of remote() requests.
        self.rrefs = rrefs

    def __len__(self) -> int:
        return len(self._jobs)

    # -- receiving -------------------------------------------------------------------------

    def on_request(self, conn: Connection, request: Request, payload: Any, segments: Any) -> None:
        peer = conn.peer
        assert peer is not None
        if request.mode == CallMode.REMOTE:
            self.rrefs.on_remote_request(peer, request)
        serves = self._pipeline.serves(request.headers)
        grads: list[Any] = []  # filled only for a request the pipeline serves
        rrefs = self.rrefs
        rrefs.take_unconfirmed()  # forget forks unpickled elsewhere (replies)
        try:
            fn, args, kwargs = self._serializer.loads(
                payload, segments, context=peer, grads=grads if serves else None
            )
        except MissingReferenceError as exc:
            self._finish(conn, request, peer, False, self._missing(request, exc))
            return
        except Exception as exc:
            self._finish(conn, request, peer, False, exc)
            return
        # RRefs in the arguments forked by a worker other than their owner: the function
        # runs once their owners confirmed them (as in torch), so they are usable there.
        unconfirmed = rrefs.take_unconfirmed()
        call = (fn, args, kwargs)
        if unconfirmed is not None:
            start = partial(self._start, conn, request, peer, call, serves, grads)
            unconfirmed._add_hook(lambda _: self._loop.call_soon_threadsafe(start))
            return
        self._start(conn, request, peer, call, serves, grads)

    def _start(
        self,
        conn: Connection,
        request: Request,
        peer: int,
        call: tuple[Any, Any, Any],
        serves: bool,
        grads: list[Any],
    ) -> None:
        fn, args, kwargs = call
        # Decided on the function itself: a hook's wrapper may hide what kind it is.
        run, async_exec = fn, is_async_execution(fn)
        if is_torch_c_function(fn):
            run = partial(checked_op, fn)
        if serves:
            try:
                run = self._serve(conn, request, peer, call, grads)
            except Exception as exc:
                self._finish(conn, request, peer, False, exc)
                return
        key = (peer, request.call_id)
        if is_coroutine_function(fn):
            self._counters.calls_on_loop += 1
            coro = self._run_coroutine(conn, request, run, async_exec, args, kwargs)
            self._jobs[key] = self._loop.create_task(coro)
            if not request.mode:
                self._came_on[key] = conn
        elif is_inline(fn) or runs_on_loop(fn, args, kwargs):
            self._counters.calls_on_loop += 1
            self._run_inline(conn, request, peer, run, async_exec, args, kwargs)
        else:
            try:
                job = self._pool.submit(
                    self._run_in_thread, conn, request, peer, run, async_exec, args, kwargs
                )
            except (ClosedError, ThreadPoolExhaustedError) as exc:  # the caller learns it
                self._finish(conn, request, peer, False, exc)
                return
            job.refused = partial(self._refused, conn, request, peer)
            self._jobs[key] = job
            if not request.mode:
                self._came_on[key] = conn

    def _serve(
        self, conn: Connection, request: Request, peer: int, call: Any, grads: list[Any]
    ) -> Callable[..., Any]:
        """Run the pipeline's callee side; returns the function wrapped by the hooks."""
        served = IncomingCall(
            conn.peer_name or str(peer), peer, self._name, request.call_id, request.target,
            request.mode == CallMode.REMOTE, request.headers or {},
        )  # fmt: skip
        fn, served.args, served.kwargs = call
        served.fn, served.grads, served.coroutine = fn, grads, is_coroutine_function(fn)
        self._served[(peer, request.call_id)] = served
        self._pipeline.incoming(served)
        return served.wrapped(fn)

    def _replying(self, request: Request, peer: int, ok: bool, value: Any) -> dict[str, Any] | None:
        """The pipeline's last look at a served request; returns its reply header fields."""
        served = self._served.pop((peer, request.call_id), None) if self._served else None
        if served is None:
            return None
        self._pipeline.replying(served, ok, value)
        return served.reply_headers or None

    def _missing(self, request: Request, exc: MissingReferenceError) -> Exception:
        name = f"{exc.module}.{exc.qualname}"
        if request.target.endswith(exc.qualname):
            return FunctionNotFoundError(name, self._name, exc.reason)
        return SerializationError(
            f"{name} (used by the arguments of {request.target}) cannot be imported on worker "
            f"{self._name!r}: {exc.reason}"
        )

    def on_cancel(self, peer: int, call_id: int) -> None:
        self._served.pop((peer, call_id), None)
        job = self._drop_job((peer, call_id))
        if job is not None:
            job.cancel()

    def _drop_job(self, key: tuple[int, int]) -> Job | None:
        if self._came_on:
            self._came_on.pop(key, None)
        return self._jobs.pop(key, None)

    def cancel_connection(self, conn: Connection) -> None:
        """``conn`` dropped: the calls that came on it have nobody to reply to."""
        for key in [k for k, c in self._came_on.items() if c is conn]:
            self._served.pop(key, None)
            job = self._drop_job(key)
            if job is not None:
                job.cancel()

    def cancel_peer(self, peer: int) -> None:
        """The caller is gone: nobody will read these replies."""
        for key in [k for k in self._jobs if k[0] == peer]:
            job = self._drop_job(key)
            assert job is not None
            job.cancel()
        for key in [k for k in self._served if k[0] == peer]:
            del self._served[key]

    # -- running ---------------------------------------------------------------------------

    async def _run_coroutine(
        self, conn: Connection, request: Request, fn: Any, async_exec: bool, args: Any,
        kwargs: Any,
    ) -> None:  # fmt: skip
        peer = conn.peer
        assert peer is not None
        try:
            result = await fn(*args, **kwargs)
            # An `async def` marked async_execution may return a value or yet another future.
            if async_exec and _is_future_like(result):
                result = await await_async_result(result)
        except asyncio.CancelledError:
            self._drop_job((peer, request.call_id))
            self._served.pop((peer, request.call_id), None)
            raise
        except BaseException as exc:
            self._finish(conn, request, peer, False, exc)
            return
        self._finish(conn, request, peer, True, result)

    def _run_inline(
        self, conn: Connection, request: Request, peer: int, fn: Any, async_exec: bool,
        args: Any, kwargs: Any,
    ) -> None:  # fmt: skip
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            self._finish(conn, request, peer, False, exc)
            return
        if async_exec:
            self._start_awaiting(conn, request, peer, result)
        else:
            self._finish(conn, request, peer, True, result)

    def _run_in_thread(
        self, conn: Connection, request: Request, peer: int, fn: Any, async_exec: bool,
        args: Any, kwargs: Any,
    ) -> None:  # fmt: skip
        post = self._pool.post
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            post(self._finish, conn, request, peer, False, exc)
            return
        if async_exec:
            post(self._await_then_finish, conn, request, peer, result)
            return
        if request.mode != 0:  # REMOTE: the value stays here, no reply frame to build
            post(self._finish, conn, request, peer, True, result)
            return
        # Pickle the result on this pool thread, off the loop.
        pieces, keep, error = self._encode_reply(request, peer, result)
        post(self._send_built, conn, request, peer, pieces, keep, error)

    def _await_then_finish(
        self, conn: Connection, request: Request, peer: int, result: Any
    ) -> None:
        if (peer, request.call_id) in self._jobs:  # else cancelled while the pool ran it
            self._start_awaiting(conn, request, peer, result)

    def _start_awaiting(self, conn: Connection, request: Request, peer: int, result: Any) -> None:
        """Reply (or keep the value, in REMOTE mode) once ``result``, a future, completes."""

        async def run() -> None:
            try:
                value = await await_async_result(result)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._finish(conn, request, peer, False, exc)
                return
            self._finish(conn, request, peer, True, value)

        self._jobs[(peer, request.call_id)] = self._loop.create_task(run())

    # -- replying --------------------------------------------------------------------------

    def _encode_reply(
        self, request: Request, peer: int, result: Any
    ) -> tuple[list[Any] | None, _Keep, BaseException | None]:
        """The reply frame, what must live while it is written (with the RRef forks it
        carries), or the error that building it raised."""
        served = self._served.get((peer, request.call_id)) if self._served else None
        rrefs = self.rrefs
        rrefs.take_minted()  # a pickling that failed elsewhere on this thread may leave some
        try:
            payload, segments, keep = self._serializer.dumps(
                result,
                context=peer,
                device_map=self._reply_device_map(peer),
                grads=None if served is None else served.reply_grads,
            )
        except Exception as exc:  # the error reply tells the hooks (see _send_error)
            self._undelivered(peer, rrefs.take_minted())  # forked for nobody
            error = SerializationError(
                f"the result of {request.target} on worker {self._name!r} cannot be sent: {exc}"
            )
            error.__cause__ = exc
            return None, (None, None), error
        forks = rrefs.take_minted()
        headers = self._replying(request, peer, True, result)
        reply = Reply(request.call_id, headers).to_fields()
        return encode_frame(reply, payload, segments), (keep, forks), None

    def _undelivered(self, peer: int, forks: Any) -> None:
        if forks:
            self.rrefs.undelivered(peer, forks)

    def _send_built(
        self,
        conn: Connection,
        request: Request,
        peer: int,
        pieces: list[Any] | None,
        keep: _Keep,
        error: BaseException | None,
    ) -> None:
        if self._drop_job((peer, request.call_id)) is None:
            self._undelivered(peer, keep[1])
            return  # cancelled meanwhile: the caller no longer waits
        self._deliver(conn, request, pieces, keep, error)

    def _deliver(
        self,
        conn: Connection,
        request: Request,
        pieces: list[Any] | None,
        keep: _Keep,
        error: BaseException | None,
    ) -> None:
        """Write a built reply, or the error that building it raised."""
        if error is not None:
            self._send_error(conn, request, error)
            return
        assert pieces is not None
        try:
            self._write(conn, pieces, *keep)
        except FrameTooLargeError as exc:  # over the caller's limit: it gets this instead
            if conn.peer is not None:
                self._undelivered(conn.peer, keep[1])
            self._send_error(conn, request, exc)
            return
        self._counters.replies_sent += 1

    def _refused(self, conn: Connection, request: Request, peer: int, exc: BaseException) -> None:
        # The exhausted pool dropped the job unrun (see WorkerPool._refuse_queued).
        if (peer, request.call_id) in self._jobs:  # else cancelled meanwhile
            self._finish(conn, request, peer, False, exc)

    def _finish(self, conn: Connection, request: Request, peer: int, ok: bool, value: Any) -> None:
        self._drop_job((peer, request.call_id))
        if not ok and self._print_errors:
            self._print_error(request, conn.peer_name, value)
        if request.mode != 0:
            self.rrefs.on_value(request, peer, ok, value)
            if request.headers:
                self._acknowledge(conn, request, peer, ok, value)
            else:
                self._replying(request, peer, ok, value)  # a hook serving all still sees it
            return
        if not ok:
            self._send_error(conn, request, value)
            return
        self._deliver(conn, request, *self._encode_reply(request, peer, value))

    def _print_error(self, request: Request, caller: str | None, exc: BaseException) -> None:
        # As torch's agent does: the callee's own log shows what failed there (the caller
        # gets the exception too). sys.stderr is looked up now: it may have been replaced.
        lines = traceback.format_exception(exc)
        text = f"On worker {self._name!r}, {request.target} called by {caller!r} raised:\n"
        print(text + "".join(lines), end="", file=sys.stderr, flush=True)

    def _acknowledge(
        self, conn: Connection, request: Request, peer: int, ok: bool, value: Any
    ) -> None:
        # A remote() request with pipeline fields: its caller's hooks wait for the end of
        # the function (torch's remote profiling does too), so say so with an empty reply.
        headers = self._replying(request, peer, ok, value)
        payload, segments, keep = self._serializer.dumps(None)
        reply = Reply(request.call_id, headers).to_fields()
        self._write(conn, encode_frame(reply, payload, segments), keep, None)

    def _send_error(self, conn: Connection, request: Request, exc: BaseException) -> None:
        _log.debug("%s raised %r for %s", request.target, exc, conn.peer_name)
        peer = conn.peer
        headers = None if peer is None else self._replying(request, peer, False, exc)
        payload = pack_exception(exc, self._name)
        fields = ErrorReply(request.call_id, headers).to_fields()
        self._write(conn, encode_frame(fields, payload), None, None)
        self._counters.errors_sent += 1
