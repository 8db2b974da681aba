"""Runs received requests and sends their replies (layer L2.4, on the agent's loop).

``async def`` functions run as tasks on the loop; synchronous ones run on the agent's
``WorkerPool`` so a blocking function never stalls the loop, and the pool thread also
pickles the result and builds the reply frame; ``@inline`` ones run on the loop.
``async_execution`` functions reply when the future they return completes. Every request
can be cancelled by the caller (timeout or cancellation): a task is cancelled, a pool job
that has not started is dropped; a ``remote()`` request whose timeout passes fails its
value. Requests that carry pipeline header fields (or every request, while a hook serves
all) pass through the call pipeline's callee side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from asyncrpc.errors import (
    ClosedError,
    FrameTooLargeError,
    RemoteProtocolError,
    RpcTimeoutError,
    SerializationError,
    ThreadPoolExhaustedError,
)
from asyncrpc.functions import is_async_execution, is_coroutine_function, is_inline
from asyncrpc.protocol.serde import MissingReferenceError, Serializer, pack_exception
from asyncrpc.protocol.serde.policy import TensorPolicy, TrackGrads
from asyncrpc.protocol.wire import body_nbytes, encode_frame
from asyncrpc.protocol.wire.messages import ACK_WANTED, CallMode, ErrorReply, Reply, Request
from asyncrpc.runtime.calls.builtins import checked_op, is_torch_c_function, runs_on_loop
from asyncrpc.runtime.calls.deadline import expired, running_until
from asyncrpc.runtime.calls.pipeline import IncomingCall, Pipeline, is_stream_source
from asyncrpc.runtime.calls.served import (
    CANCEL_GRACE_S,
    Caller,
    OwnerValues,
    Producers,
    Runner,
    ServedRequest,
    Writer,
    await_async_result,
    is_future_like,
    missing_reference_error,
    print_request_error,
)
from asyncrpc.runtime.futures import Future, add_hook
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.net.links import FrameInParts, write_in_parts
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.ports import Loop

__all__ = ["Dispatcher"]

_log = logging.getLogger(__name__)
# What a built reply keeps alive while it is written, the RRef forks it carries, and the
# request as the pipeline saw it (None: it did not go through the pipeline).
_Keep = tuple[object, Any, IncomingCall | None]


class Dispatcher:
    """Executes requests for one agent."""

    def __init__(
        self,
        name: str,
        loop: Loop,
        serializer: Serializer,
        write: Writer,
        counters: Counters,
        pipeline: Pipeline,
        owner: OwnerValues,
        producers: Producers,
        print_errors: bool = True,
    ) -> None:
        self._name = name
        self._print_errors = print_errors
        self._loop = loop.aio
        self._pool = loop.pool
        self._serializer = serializer
        self._write = write
        self._counters = counters
        self._pipeline = pipeline
        # The requests running as a task or a pool job, by (caller, call id).
        self._running: dict[tuple[int, int], ServedRequest] = {}
        # Keeps the values of remote() requests, and follows the forks replies carry.
        self._owner = owner
        # Runs the generators of stream requests (CallMode.STREAM).
        self._producers = producers

    def __len__(self) -> int:
        return len(self._running)

    # -- receiving -------------------------------------------------------------------------

    def on_request(
        self, conn: Caller, request: Request, payload: Any, segments: Any, nbytes: int = 0
    ) -> None:
        """Serve a request whose frame (``nbytes`` long, 0: not known) has just come."""
        peer = conn.peer
        assert peer is not None
        served = ServedRequest(conn, request, peer)
        if request.mode == CallMode.CODED:  # its payload is no pickle: never unpickle it
            error = RemoteProtocolError(f"a coded call ({request.target!r}) off a lane")
            self._finish(served, False, error)
            return
        owner = self._owner
        if served.remote:
            owner.on_remote_request(peer, request)
            self.watch_remote(peer, request)
        elif request.mode == CallMode.STREAM:  # its credit may come before it starts
            self._producers.expect(
                conn, peer, request.call_id, request.target, request.timeout, served.deadline
            )
        owner.take_unconfirmed()  # forget forks unpickled elsewhere (replies)
        try:
            if self._pipeline.serves(request.headers):
                self._receiving(served, nbytes)
            incoming = served.incoming
            fn, args, kwargs = self._serializer.loads(
                payload,
                segments,
                context=peer,
                policy=None if incoming is None else incoming.policy,
            )
        except MissingReferenceError as exc:
            self._finish(served, False, self._missing(request, exc))
            return
        except Exception as exc:
            self._finish(served, False, exc)
            return
        # RRefs in the arguments forked by a worker other than their owner: the function
        # runs once their owners confirmed them (as in torch), so they are usable there.
        unconfirmed = owner.take_unconfirmed()
        call = (fn, args, kwargs)
        if unconfirmed is not None:
            start = partial(self._start, served, call)
            add_hook(unconfirmed, lambda _: self._loop.call_soon_threadsafe(start))
            return
        self._start(served, call)

    def on_unpickled(
        self, conn: Caller, request: Request, call: tuple[Any, Any, Any],
        incoming: IncomingCall | None = None,
    ) -> None:  # fmt: skip
        """Run a request whose payload a lane's thread already unpickled (through the
        hooks' ``receiving`` stage when ``incoming`` is given): a function that runs on
        the loop (``async def``, ``async_execution``, ``@inline``)."""
        peer = conn.peer
        assert peer is not None
        served = ServedRequest(conn, request, peer)
        served.incoming = incoming
        self._start(served, call)

    def _start(self, served: ServedRequest, call: tuple[Any, Any, Any]) -> None:
        if expired(served.deadline) and served.request.mode != CallMode.STREAM:
            self._expired(served)
            return
        fn, args, kwargs = call
        # Decided on the function itself: a hook's wrapper may hide what kind it is.
        run, async_exec = fn, is_async_execution(fn)
        if is_torch_c_function(fn):
            run = partial(checked_op, fn)
        if served.incoming is not None:
            try:
                run = self._serve(served.incoming, call)
            except Exception as exc:
                self._finish(served, False, exc)
                return
        request = served.request
        if request.mode == CallMode.STREAM:  # a generator, driven by calls/streams/producer.py
            self._start_stream(served, fn, run, args, kwargs)
            return
        if is_coroutine_function(fn):
            self._counters.calls_on_loop += 1
            coro = self._run_coroutine(served, run, async_exec, args, kwargs)
            self._run_as(served, self._loop.create_task(coro))
            served.bound = not served.remote
        elif is_inline(fn) or runs_on_loop(fn, args, kwargs):
            self._counters.calls_on_loop += 1
            self._run_inline(served, run, async_exec, args, kwargs)
        else:
            try:
                job = self._pool.submit(self._run_in_thread, served, run, async_exec, args, kwargs)
            except (ClosedError, ThreadPoolExhaustedError) as exc:  # the caller learns it
                self._finish(served, False, exc)
                return
            job.refused = partial(self._refused, served)
            self._run_as(served, job)
            served.bound = not served.remote

    def _start_stream(
        self, served: ServedRequest, fn: Any, run: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        """Start a streaming call's function, its items pickled as the hooks say."""
        pipeline, incoming, fielded = self._pipeline, served.incoming, True
        if incoming is None and is_stream_source(fn) and pipeline.overriding("stream_items"):
            # A stream argument this worker sent, read by the peer: its items are this
            # worker's own, so the hooks choose their policy even with no header field
            # (but no hook has state for it: no item fields, as without the pipeline).
            self._receiving(served, 0)
            incoming, fielded = served.incoming, False
        if incoming is not None:
            incoming.own_items = is_stream_source(fn)
        # The items' tensor policy is the hooks' to say (the pipeline's stream_items).
        policy = ready = None
        if incoming is not None:
            policy = pipeline.item_policy(incoming)
            ready = pipeline.items_ready(incoming)  # CUDA copies still running, per item
        dumps = partial(self._serializer.dumps, context=served.peer, policy=policy)
        fields = None  # the hooks' fields for each item (distributed autograd's)
        if incoming is not None and fielded and pipeline.overriding("item_sent"):
            fields = partial(self._item_fields, incoming, policy)
        replying = partial(self._replying, served)
        # What the hooks keep per peer rides on every frame to the reader (CUDA IPC).
        links = pipeline.stream_links(served.peer)
        self._producers.start(
            served.peer, served.request.call_id, fn, run, args, kwargs, replying, dumps,
            fields, ready, links,
        )  # fmt: skip

    def _run_as(self, served: ServedRequest, runner: Runner) -> None:
        served.runner = runner
        self._running[served.key] = served

    def _receiving(self, served: ServedRequest, nbytes: int) -> None:
        """The request as the pipeline sees it, its policies set before it is unpickled."""
        request, peer = served.request, served.peer
        served.incoming = self._pipeline.received(
            served.conn.peer_name or str(peer), peer, self._name, request.call_id,
            request.target, served.remote, request.headers, nbytes,
        )  # fmt: skip

    def _serve(self, incoming: IncomingCall, call: Any) -> Callable[..., Any]:
        """Run the pipeline's callee side; returns the function wrapped by the hooks."""
        result: Callable[..., Any] = self._pipeline.serve(incoming, *call)
        return result

    def _item_fields(
        self, incoming: IncomingCall, policy: TensorPolicy | None
    ) -> dict[str, Any] | None:
        """The header fields of a stream item just pickled with ``policy``."""
        grads = policy.take() if isinstance(policy, TrackGrads) else []
        return self._pipeline.item_fields(incoming, grads)

    def _replying(
        self, served: ServedRequest, ok: bool, value: Any, payload: Any = b"", segments: Any = ()
    ) -> dict[str, Any] | None:
        """The pipeline's last look at a served request; returns its reply header fields.
        ``payload`` and ``segments``: the reply's, pickled (none: no reply is sent)."""
        incoming, served.incoming = served.incoming, None
        if incoming is None:
            return None
        # Sized only here, where a hook looks: an untraced reply is never measured.
        nbytes = body_nbytes(payload, segments) if payload or segments else 0
        return self._pipeline.reply_fields(incoming, ok, value, nbytes)

    def _missing(self, request: Request, exc: MissingReferenceError) -> Exception:
        return missing_reference_error(self._name, request, exc)

    # -- cancelling ------------------------------------------------------------------------

    def watch_remote(self, peer: int, request: Request) -> None:
        """Fail the value of a remote() request that outlives its caller's timeout (a lane's
        thread serves some, and hands them here, on the loop)."""
        if request.timeout > 0:  # the caller's deadline holds here too
            self._loop.call_later(request.timeout, self._expire_remote, peer, request)

    def _expire_remote(self, peer: int, request: Request) -> None:
        # A remote() request still running when its caller's timeout passes: the value
        # fails with RRefTimeoutError, and the function is cancelled as on a Cancel.
        if self._owner.expire_value(request):
            self.on_cancel(peer, request.call_id)

    def on_cancel(self, peer: int, call_id: int) -> None:
        served = self._running.pop((peer, call_id), None)
        if served is not None:
            self._cancel(served)

    def _cancel(self, served: ServedRequest) -> None:
        served.incoming = None  # the hooks are not told of a cancelled request
        runner, served.runner = served.runner, None
        if runner is not None:
            runner.cancel()

    def _stop_running(self, served: ServedRequest) -> bool:
        """It is done running; False if it was no longer running (cancelled meanwhile)."""
        # The runner holds the request (and its arguments, RRefs among them) and the
        # request its runner: break that cycle now, or the arguments live until a GC pass.
        served.runner = None
        return self._running.pop(served.key, None) is not None

    def cancel_connection(self, conn: Caller) -> None:
        """``conn`` dropped: the calls that came on it have nobody to reply to; remote()
        requests run on (their value must still land here)."""
        for served in [s for s in self._running.values() if s.conn is conn and s.bound]:
            del self._running[served.key]
            self._cancel(served)

    def running_peers(self) -> set[int]:
        """The ranks whose requests run here now (their connections are not idle)."""
        return {served.peer for served in self._running.values()}

    def cancel_peer(self, peer: int) -> None:
        """The caller is gone: nobody will read these replies."""
        for served in [s for s in self._running.values() if s.peer == peer]:
            del self._running[served.key]
            self._cancel(served)

    # -- running ---------------------------------------------------------------------------

    def _expired(self, served: ServedRequest) -> None:
        """A request whose caller's deadline passed before it started: it never runs. It
        is answered all the same, with the timeout error its caller has already (which
        it ignores): what follows replies (the RRef forks the request carried) must
        still settle. A remote() value fails, as its deadline watch fails it. Nothing is
        printed: the function raised nothing."""
        self._stop_running(served)
        self._counters.calls_expired += 1
        request = served.request
        error = RpcTimeoutError(self._name, request.target, request.timeout)
        if not served.remote:
            self._send_error(served, error)
            return
        self._owner.on_value(request, served.peer, False, error)
        if request.headers:
            self._acknowledge(served, False, error)
        else:
            self._replying(served, False, error)

    async def _run_coroutine(
        self, served: ServedRequest, fn: Any, async_exec: bool, args: Any, kwargs: Any
    ) -> None:
        deadline = served.deadline
        limit = None
        try:
            with running_until(deadline, served.peer):
                if deadline is None:
                    result = await fn(*args, **kwargs)
                else:  # cancelled at its deadline: its own finally blocks run
                    # A little after it: the caller's own timer fires first, and the
                    # caller gets its own error, never this reply racing it.
                    limit = asyncio.timeout(deadline - time.monotonic() + CANCEL_GRACE_S)
                    try:
                        async with limit:
                            result = await fn(*args, **kwargs)
                    except TimeoutError as exc:
                        if not limit.expired():
                            raise  # the function's own timeout, not ours
                        request = served.request
                        raise RpcTimeoutError(self._name, request.target, request.timeout) from exc
            # An `async def` marked async_execution may return a value or yet another future.
            if async_exec and is_future_like(result):
                result = await await_async_result(result)
        except asyncio.CancelledError:
            self._stop_running(served)
            served.incoming = None
            # The task keeps this error, whose traceback keeps this frame: drop what the
            # frame holds (the timeout holds the task: a cycle only the GC would break),
            # so the arguments go now, and a stream among them closes itself now.
            args = kwargs = limit = None
            raise
        except BaseException as exc:
            self._finish(served, False, exc)
            return
        self._finish(served, True, result)

    def _run_inline(
        self, served: ServedRequest, fn: Any, async_exec: bool, args: Any, kwargs: Any
    ) -> None:
        try:
            with running_until(served.deadline, served.peer):
                result = fn(*args, **kwargs)
        except BaseException as exc:
            self._finish(served, False, exc)
            return
        if async_exec:
            self._start_awaiting(served, result)
        else:
            self._finish(served, True, result)

    def _run_in_thread(
        self, served: ServedRequest, fn: Any, async_exec: bool, args: Any, kwargs: Any
    ) -> None:
        post = self._pool.post
        if expired(served.deadline):  # queued behind others until its caller gave up
            post(self._expired, served)
            return
        try:
            with running_until(served.deadline, served.peer):
                result = fn(*args, **kwargs)
        except BaseException as exc:
            post(self._finish, served, False, exc)
            return
        if async_exec:
            post(self._await_then_finish, served, result)
            return
        if served.remote:  # the value stays here, no reply frame to build
            post(self._finish, served, True, result)
            return
        # Pickle the result on this pool thread, off the loop.
        pieces, keep, error = self._encode_reply(served, result)
        post(self._send_built, served, pieces, keep, error)

    def _await_then_finish(self, served: ServedRequest, result: Any) -> None:
        if served.key in self._running:  # else cancelled while the pool ran it
            self._start_awaiting(served, result)

    def _start_awaiting(self, served: ServedRequest, result: Any) -> None:
        """Reply (or keep the value, in REMOTE mode) once ``result``, a future, completes."""
        if isinstance(result, Future) and result.done() and result.exception() is None:
            # Done already (an @inline function whose work ended on the spot): replied now,
            # not from a task one loop turn later. Failures take the task's way below.
            self._finish(served, True, result.value())
            return

        async def run() -> None:
            try:
                value = await await_async_result(result)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._finish(served, False, exc)
                return
            self._finish(served, True, value)

        self._run_as(served, self._loop.create_task(run()))

    # -- replying --------------------------------------------------------------------------

    def _encode_reply(
        self, served: ServedRequest, result: Any
    ) -> tuple[list[Any] | None, _Keep, BaseException | None]:
        """The reply frame, what must live while it is written (with the RRef forks it
        carries), or the error that building it raised."""
        incoming, peer = served.incoming, served.peer
        try:  # RRefs pickled before a failure: the serializer undoes their forks
            payload, segments, keep, forks = self._serializer.dumps(
                result, context=peer, policy=None if incoming is None else incoming.reply_policy
            )
        except Exception as exc:  # the error reply tells the hooks (see _send_error)
            target = served.request.target
            error = SerializationError(
                f"the result of {target} on worker {self._name!r} cannot be sent: {exc}"
            )
            error.__cause__ = exc
            return None, (None, None, None), error
        headers = self._replying(served, True, result, payload, segments)
        if forks and getattr(served.conn, "acks_forks", False):
            # A lane (runtime/lanes/): its caller says when it has read the forks.
            headers = {**(headers or {}), ACK_WANTED: 1}
        reply = Reply(served.request.call_id, headers).to_fields()
        return encode_frame(reply, payload, segments), (keep, forks, incoming), None

    def _undelivered(self, peer: int, forks: Any) -> None:
        if forks:
            self._owner.undelivered(peer, forks)

    def _send_built(
        self,
        served: ServedRequest,
        pieces: list[Any] | None,
        keep: _Keep,
        error: BaseException | None,
    ) -> None:
        if not self._stop_running(served):
            self._undelivered(served.peer, keep[1])
            return  # cancelled meanwhile: the caller no longer waits
        self._deliver(served, pieces, keep, error)

    def _deliver(
        self,
        served: ServedRequest,
        pieces: list[Any] | None,
        keep: _Keep,
        error: BaseException | None,
    ) -> None:
        """Write a built reply, or the error that building it raised."""
        if error is not None:
            self._send_error(served, error)
            return
        assert pieces is not None
        incoming = keep[2]
        ready = None if incoming is None else self._pipeline.reply_ready(incoming)
        if ready is not None:  # GPU work still fills its bytes: written once it is done
            self._loop.create_task(self._write_when_ready(served, pieces, keep, ready))
            return
        self._write_reply(served, pieces, keep)

    async def _write_when_ready(
        self, served: ServedRequest, pieces: list[Any], keep: _Keep, ready: Awaitable[None]
    ) -> None:
        conn = served.conn
        if isinstance(ready, FrameInParts) and isinstance(conn, Connection) and not keep[1]:
            # A large reply whose CUDA tensors reach the host chunk by chunk: its first
            # chunks are written while the next are copied (no forks to follow in it).
            try:
                await write_in_parts(conn, pieces, ready, keep[0])
            except FrameTooLargeError as exc:  # over the caller's limit: it gets this
                self._send_error(served, exc)
                return
            except ClosedError:
                return  # the caller is gone, or its connection: the reply goes with it
            self._counters.replies_sent += 1
            return
        try:
            await ready
        except Exception as exc:  # the caller gets what held its reply back
            self._undelivered(served.peer, keep[1])
            self._send_error(served, exc)
            return
        self._write_reply(served, pieces, keep)

    def _write_reply(self, served: ServedRequest, pieces: list[Any], keep: _Keep) -> None:
        try:
            self._write(served.conn, pieces, keep[0], keep[1])
        except FrameTooLargeError as exc:  # over the caller's limit: it gets this instead
            self._undelivered(served.peer, keep[1])
            self._send_error(served, exc)
            return
        self._counters.replies_sent += 1

    def _refused(self, served: ServedRequest, exc: BaseException) -> None:
        # The exhausted pool dropped the job unrun (see WorkerPool._refuse_queued).
        if served.key in self._running:  # else cancelled meanwhile
            self._finish(served, False, exc)

    def _finish(self, served: ServedRequest, ok: bool, value: Any) -> None:
        self._stop_running(served)
        request = served.request
        if not ok and self._print_errors:
            self._print_error(request, served.conn.peer_name, value)
        if request.mode == CallMode.STREAM:
            self._producers.forget(served.peer, request.call_id)  # never started: the error replies
        elif served.remote:
            self._owner.on_value(request, served.peer, ok, value)
            if request.headers:
                self._acknowledge(served, ok, value)
            else:
                self._replying(served, ok, value)  # a hook serving all still sees it
            return
        if not ok:
            self._send_error(served, value)
            return
        self._deliver(served, *self._encode_reply(served, value))

    def _print_error(self, request: Request, caller: str | None, exc: BaseException) -> None:
        print_request_error(self._name, request, caller, exc)

    def _acknowledge(self, served: ServedRequest, ok: bool, value: Any) -> None:
        # A remote() request with pipeline fields: its caller's hooks wait for the end of
        # the function (torch's remote profiling does too), so say so with an empty reply.
        payload, segments, keep, _ = self._serializer.dumps(None)
        headers = self._replying(served, ok, value, payload, segments)
        reply = Reply(served.request.call_id, headers).to_fields()
        self._write(served.conn, encode_frame(reply, payload, segments), keep, None)

    def _send_error(self, served: ServedRequest, exc: BaseException) -> None:
        _log.debug("%s raised %r for %s", served.request.target, exc, served.conn.peer_name)
        payload = pack_exception(exc, self._name)
        headers = self._replying(served, False, exc, payload)
        fields = ErrorReply(served.request.call_id, headers).to_fields()
        self._write(served.conn, encode_frame(fields, payload), None, None)
        self._counters.errors_sent += 1
