"""The outbox: outgoing calls from encoding to their end (layer L2.4); the ``Calls`` port.

A call is pickled and framed once, on the calling thread, through the call pipeline's
caller side, into one frozen ``EncodedRequest``; ``start`` hands it to the loop, which
registers it among the pending calls (with its timeout) and writes it to the peer. Whatever
ends it first (the reply, an error reply, its timeout, the caller's cancellation, a lost
connection or peer, shutdown) pops it, so a call completes exactly once; a timed-out or
cancelled call tells the callee with a Cancel. The call pipeline's ``ready`` stage may
hold a request back (GPU work still filling its bytes); the network keeps it in order
meanwhile. ``call_future`` (and ``call_sync``), ``call`` and ``send_remote`` are the ways
in: thread-side, coroutine-side and ``remote()``. It owns the table of pending calls, whose
deadlines expire straight into it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from asyncrpc.errors import ClosedError, PeerLostError, RpcTimeoutError
from asyncrpc.errorstate import own_copy
from asyncrpc.functions import is_async_execution, is_coroutine_function
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT, WorkerInfo
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, encode_frame, frame_nbytes
from asyncrpc.protocol.wire.messages import (
    CallMode,
    Request,
    coded_request_fields,
    optional_headers,
)
from asyncrpc.runtime.calls.deadline import inherited
from asyncrpc.runtime.calls.pending import (
    EncodedRequest,
    Observed,
    PendingCall,
    PendingCalls,
    Waiter,
    describe_function,
)
from asyncrpc.runtime.calls.pipeline import CallKind, OutgoingCall, Pipeline
from asyncrpc.runtime.futures import Future, on_cancel
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Frames, Loop, OutgoingFrame, Register
from asyncrpc.runtime.shm.shm import SHM_TAG_PREFIX

_log = logging.getLogger(__name__)

__all__ = ["NOT_ON_LANE", "EncodedRequest", "Observed", "Outbox", "SyncLanes"]


# What ``Outbox.call_on_lane`` returns for a call it did not make (no lane).
NOT_ON_LANE: Final = object()


class SyncLanes(Protocol):
    """Calling threads' own connections for synchronous calls (``runtime/lanes/``)."""

    def lane(self, rank: int, nbytes: int) -> Any | None:
        """This thread's lane to ``rank`` for a plain call of ``nbytes`` (None: none)."""

    UNSENT: object  # what ``call`` returns when the request never left

    def send(self, lane: Any, encoded: EncodedRequest) -> bool:
        """Write a request that expects no reply on ``lane``; False if it never left."""

    def call(self, lane: Any, encoded: EncodedRequest) -> Any:
        """Run one call on ``lane``, blocking this thread until its reply (or ``UNSENT``)."""

    def start(self, lane: Any, encoded: EncodedRequest) -> Any | None:
        """Write a call's request on ``lane`` (None: it never left); ``finish`` reads."""

    def finish(self, started: Any) -> Any:
        """The reply of a call ``start`` wrote: its value, or its error raised."""


def _lane_safe(fn: Any, encoded: EncodedRequest) -> bool:
    """Whether a lane may carry the call: only lane-safe hooks saw it, no RRef fork and no
    shared memory in it (a lane's callee maps none), and a function that does not run on
    the callee's loop."""
    observed = encoded.observed
    return (
        encoded.forks is None
        and not encoded.shared
        and (observed is None or all(hook.lane_safe for hook in observed[0]))
        and not is_coroutine_function(fn)
        and not is_async_execution(fn)
    )


class Outbox:
    """The outgoing calls of one worker."""

    def __init__(
        self,
        name: str,
        loop: Loop,
        *,
        serializer: Serializer,
        pipeline: Pipeline,
        directory: Directory,
        frames: Frames,
        undelivered: Callable[[int, list[ForkPair]], None],
        unlend: Callable[[object], None],
        counters: Counters,
        default_timeout: float,
        lanes: SyncLanes | None = None,
        inherit_deadlines: bool = True,
    ) -> None:
        self._name, self.loop = name, loop.aio
        self.run_on_loop = loop.run_on_loop
        self._serializer, self._pipeline, self._directory = serializer, pipeline, directory
        self._frames, self._undelivered, self._unlend = frames, undelivered, unlend
        self._counters, self._default_timeout = counters, default_timeout
        self._lanes = lanes
        self._inherit = inherit_deadlines
        self._on_loop_thread = loop.on_loop_thread
        # Per calling thread, its last call_future to each rank (weakly: its pending call
        # holds it until the reply). A synchronous call to a rank whose earlier call from
        # the same thread is still pending takes the same connection, behind it, so that
        # the callee starts them in the order this thread made them.
        self._issued = threading.local()
        self.pending = PendingCalls(loop.aio, self.expire)
        self._call_ids = itertools.count(1)
        self.closed = False
        # Requests held aside until their GPU work is done (see ``start``), by calling
        # thread and rank: a later request from the same thread to the same rank waits
        # behind, so the callee still starts one thread's calls in the order it made them.
        self._held: dict[tuple[int, int], asyncio.Task[None]] = {}

    # -- the group's members, as the Calls port answers about them --------------------------

    @property
    def pipeline(self) -> Pipeline:
        """The call pipeline its calls go through (a stream's consumer asks it too)."""
        return self._pipeline

    def resolve(self, to: Any) -> int:
        """The rank of ``to`` (a name, rank or ``WorkerInfo``).

        Raises:
            UnknownWorkerError: no member of the group is ``to``.
        """
        return self._directory.resolve(to)

    def worker_info(self, rank: int) -> WorkerInfo:
        return self._directory.worker_info(rank)

    def effective_timeout(self, timeout: float) -> float:
        """torch's rule: a negative timeout means the default, 0 means none (so does inf);
        inside a function served for a peer, what is left of that request's deadline when
        it is shorter (``deadline.inherited``; unless ``inherit_deadlines`` is off).

        Raises:
            ValueError: the timeout is NaN.
        """
        if math.isnan(timeout):
            raise ValueError("the timeout is NaN")
        if timeout < 0 or timeout == UNSET_RPC_TIMEOUT:
            timeout = self._default_timeout
        elif math.isinf(timeout):
            timeout = 0.0
        return inherited(timeout) if self._inherit else timeout

    def stream_limit(self, total: float) -> float:
        """The limit of a whole stream: ``total`` seconds (0, a negative number or inf:
        none), or what is left of the served request's deadline when that is shorter."""
        if math.isnan(total):
            raise ValueError("the timeout is NaN")
        if total < 0 or math.isinf(total):
            total = 0.0
        return inherited(total) if self._inherit else total

    # -- encoding (the calling thread) -----------------------------------------------------

    def encode(
        self, rank: int, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        kind: CallKind, mode: int = CallMode.CALL, register: Register | None = None,
        target: str | None = None,
    ) -> EncodedRequest:  # fmt: skip
        """Pickle and frame a request on the calling thread, through the call pipeline.

        Args:
            kind: how the call was made, for the hooks.
            register: for ``remote()``, makes the RRef and fork ids once the payload is
                pickled and the hooks have run (so a failure leaves no RRef state).
            target: the name the hooks and errors use (default: the function's).

        Raises:
            ClosedError: this worker is shut down.
            SerializationError: the function or an argument cannot be pickled.
        """
        if self.closed:
            raise ClosedError(f"worker {self._name!r} is shut down")
        hooks = self._pipeline.active_hooks()
        call = None
        target = describe_function(fn) if target is None else target
        if hooks:
            callee = self._directory.addresses[rank].name
            call = OutgoingCall(kind, self._name, callee, rank, fn, target, args, kwargs)
            Pipeline.prepare(hooks, call)  # the hooks' tensor policy, before pickling
        # The RRef forks its pickling mints come back with the payload (an argument that
        # cannot be pickled: the serializer undoes those it minted before).
        payload, segments, keep, forks = self._serializer.dumps(
            (fn, args, kwargs), context=rank, policy=None if call is None else call.policy
        )
        call_id = next(self._call_ids)
        headers = None
        try:
            if call is not None:
                call.call_id = call_id
                Pipeline.outgoing(hooks, call)
                headers = call.headers or None
            rref_id = fork_id = None
            if register is not None:
                rref_id, fork_id = register()
                if fork_id is not None:  # the caller's fork of the value: followed too
                    forks = [*forks, (rref_id, fork_id)] if forks else [(rref_id, fork_id)]
            request = Request(call_id, timeout, mode, target, rref_id, fork_id, headers)
            pieces = encode_frame(request.to_fields(), payload, segments)
            if call is not None:
                call.nbytes = frame_nbytes(pieces)  # for the hooks' ``completed``
        except BaseException:
            self._unlend(keep)  # no frame: no peer will give its shared chunks back
            if forks:
                self._undelivered(rank, forks)  # RRefs forked for nobody
            raise
        observed = None if call is None else (hooks, call)
        shared = bool(segments) and any(tag.startswith(SHM_TAG_PREFIX) for _, tag in segments)
        return EncodedRequest(call_id, rank, target, timeout, pieces, keep, observed, forks, shared)

    # -- the three ways in -----------------------------------------------------------------

    def call_future(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        kind: CallKind = CallKind.ASYNC, target: str | None = None,
    ) -> Future[Any]:  # fmt: skip
        """Start a call from any thread and return its ``asyncrpc.Future``; cancelling the
        future cancels the call (and tells the callee)."""
        rank = self._directory.resolve(to)
        encoded = self.encode(rank, fn, args, kwargs, self.effective_timeout(timeout), kind,
                              target=target)  # fmt: skip
        future = self._start_future(encoded)
        if self._lanes is not None:
            issued: dict[int, weakref.ref[Future[Any]]] | None = getattr(
                self._issued, "by_rank", None
            )
            if issued is None:
                issued = self._issued.by_rank = {}
            issued[rank] = weakref.ref(future)
        return future

    def _start_future(self, encoded: EncodedRequest) -> Future[Any]:
        future: Future[Any] = Future(loop=self.loop)
        call_id = encoded.call_id
        on_cancel(future, lambda: self.loop.call_soon_threadsafe(self.cancel, call_id))
        self.run_on_loop(self.start, encoded, future, threading.get_ident())
        return future

    def call_sync(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None = None,
    ) -> Any:  # fmt: skip
        """Run a call for a thread that blocks until its result (``rpc_sync``).

        A plain call (only lane-safe hooks active, no RRef fork, a small frame, a function
        that does not run on the callee's loop) goes on this thread's lane to the callee,
        when it has one (``runtime/lanes/``); any other the way ``call_future`` sends it.

        Raises:
            The errors of ``call_future`` and of the call.
        """
        rank = self._directory.resolve(to)
        encoded = self.encode(rank, fn, args, kwargs, self.effective_timeout(timeout),
                              CallKind.SYNC, target=target)  # fmt: skip
        return self._sync(rank, fn, encoded)

    def call_on_lane(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        """``call_sync`` for a thread that has a lane to ``to``; ``NOT_ON_LANE`` where it
        has none (nothing pickled, nothing sent: the call counts toward opening one, as
        an ``rpc_sync`` does). For callers with a better way than the loop's for the calls
        a lane does not take: a backward hop (``asyncrpc.autograd.engine``) sends its
        gradients from the thread that ran its pass, and reads the reply there too.

        Raises:
            The errors of ``call_sync``.
        """
        found = self._lane_ready(to)
        if found is None:
            return NOT_ON_LANE
        rank, _ = found
        encoded = self.encode(
            rank, fn, args, kwargs, self.effective_timeout(timeout), CallKind.SYNC
        )
        return self._sync(rank, fn, encoded)

    def _lane_ready(self, to: Any) -> tuple[int, SyncLanes] | None:
        """``to``'s rank and the lanes, where this thread has a lane to it that may take
        a call now; None where it has none (the call counts toward opening one, as an
        ``rpc_sync`` does), is the loop's, or has a ``call_future`` to ``to`` pending (a
        lane would pass it)."""
        lanes = self._lanes
        if lanes is None or self._on_loop_thread():
            return None
        rank = self._directory.resolve(to)
        if self._behind_pending(rank) or lanes.lane(rank, 0) is None:
            return None
        return rank, lanes

    def call_coded_on_lane(self, to: Any, coded: CodedCall, args: Any, timeout: float) -> Any:
        """``call_on_lane`` for a coded call (``protocol/coded.py``): its arguments
        coded, not pickled, and so its reply where the callee can. Pickled as
        ``call_on_lane`` sends it where a hook is active or the codec cannot say them.

        Raises:
            The errors of ``call_sync``.
        """
        found = self._lane_ready(to)
        if found is None:
            return NOT_ON_LANE  # checked before the codec runs: no coding for nothing
        rank, lanes = found
        timeout = self.effective_timeout(timeout)
        dumped = None if self._pipeline.active_hooks() else coded.dump_args(args)
        if dumped is None:  # pickled, through the hooks, as call_on_lane sends it
            encoded = self.encode(rank, coded.run, args, {}, timeout, CallKind.SYNC)
            return self._sync(rank, coded.run, encoded)
        if self.closed:
            raise ClosedError(f"worker {self._name!r} is shut down")
        payload, segments, keep = dumped
        call_id = next(self._call_ids)
        pieces = encode_frame(coded_request_fields(call_id, timeout, coded.name), payload, segments)
        lane = lanes.lane(rank, frame_nbytes(pieces))
        if lane is None:
            return NOT_ON_LANE
        encoded = EncodedRequest(
            call_id, rank, coded.name, timeout, pieces, keep, None, None, coded=coded.load_result
        )
        value = lanes.call(lane, encoded)
        return NOT_ON_LANE if value is lanes.UNSENT else value

    def start_sync(
        self, to: Any, fn: Any, args: Sequence[Any], timeout: float, loop_fn: Any = None
    ) -> Any:
        """The first half of ``call_sync``, for a thread with several calls to wait for:
        the request is written on this thread's lane now, and ``finish_sync`` reads the
        reply, so the callees work at once. Where this thread has no lane to the callee,
        the call starts the loop's way, running ``loop_fn`` (default ``fn``: a function
        that would rather run on the callee's loop than on a lane's thread may be given
        here); ``fn`` itself where a lane there cannot carry this call.

        Raises:
            The errors of ``call_future``.
        """
        found = self._lane_ready(to)
        if found is None:
            return self.call_future(to, loop_fn or fn, args, {}, timeout, CallKind.SYNC)
        rank, lanes = found
        encoded = self.encode(rank, fn, args, {}, self.effective_timeout(timeout), CallKind.SYNC)
        lane = lanes.lane(rank, frame_nbytes(encoded.pieces)) if _lane_safe(fn, encoded) else None
        started = None if lane is None else lanes.start(lane, encoded)
        # Too large for the lane, or what a lane does not carry: ``fn`` the loop's way.
        return self._start_future(encoded) if started is None else started

    def finish_sync(self, started: Any) -> Any:
        """The reply of a call ``start_sync`` started (its value, or its error raised)."""
        if isinstance(started, Future):
            return started.wait()
        assert self._lanes is not None  # a lane call was started: there are lanes
        return self._lanes.finish(started)

    def _sync(self, rank: int, fn: Any, encoded: EncodedRequest) -> Any:
        """An encoded call for a thread that blocks until its result: on the thread's
        lane where it may take one, else the loop's way."""
        lanes = self._lanes
        if lanes is not None and not self._behind_pending(rank) and _lane_safe(fn, encoded):
            lane = lanes.lane(rank, frame_nbytes(encoded.pieces))
            if lane is not None:
                value = lanes.call(lane, encoded)
                if value is not lanes.UNSENT:
                    return value
                # The lane broke before the request left: it goes the loop's way.
        return self._start_future(encoded).wait()

    def _behind_pending(self, rank: int) -> bool:
        """Whether this thread's last ``call_future`` to ``rank`` is still pending."""
        issued = getattr(self._issued, "by_rank", None)
        earlier = None if issued is None else issued.get(rank)
        future = None if earlier is None else earlier()
        return future is not None and not future.done()

    async def call(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        """Call on the loop; cancelling the awaiting task cancels the remote work."""
        directory = self._directory
        if directory.lazy:
            await directory.lookup_async(directory.destination(to))  # off the loop
        rank = directory.resolve(to)
        encoded = self.encode(
            rank, fn, args, kwargs, self.effective_timeout(timeout), CallKind.ASYNC
        )
        waiter: asyncio.Future[Any] = self.loop.create_future()
        self.start(encoded, waiter, threading.get_ident())
        try:
            value = await waiter
        except asyncio.CancelledError:
            self.cancel(encoded.call_id)
            raise
        observed = encoded.observed
        if observed is not None and observed[1].on_value is not None:
            observed[1].on_value()  # e.g. this thread's CUDA streams wait for the reply
        return value

    def send_remote(
        self, rank: int, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        register: Register, target: str | None = None,
    ) -> Future[Any] | None:  # fmt: skip
        """Send a ``remote()`` request from any thread; the owner keeps the value.

        ``register`` makes the RRef id and the caller's fork id (None when the owner is
        this worker: its value then never leaves the process). Without pipeline hooks
        nothing waits for it here (the RRef protocol confirms it): from a thread that has
        a lane to the owner, it goes on the lane, ahead of what the thread sends next
        there (its ``to_here``). With hooks, the owner acknowledges the end of the
        function, and a pending call tells the hooks.

        Returns:
            With hooks, the future of that acknowledgement (done after the hooks were
            told); else None.

        Raises:
            SerializationError: the function or an argument cannot be pickled.
        """
        encoded = self.encode(
            rank, fn, args, kwargs, timeout, CallKind.REMOTE, CallMode.REMOTE, register, target
        )
        if encoded.observed is None:
            if not self._sent_on_lane(rank, fn, encoded):
                e = encoded
                frame = OutgoingFrame(rank, e.pieces, e.keep, e.forks)
                self.run_on_loop(self._frames.send, frame)
            return None
        acknowledged: Future[Any] = Future(loop=self.loop)
        self.run_on_loop(self.start, encoded, acknowledged)
        return acknowledged

    def _sent_on_lane(self, rank: int, fn: Any, encoded: EncodedRequest) -> bool:
        """Send a remote() request on this thread's lane to ``rank``, if it may take one
        (its only fork the caller's own, a small frame, no earlier call still pending)."""
        lanes = self._lanes
        forks = encoded.forks
        if (
            lanes is None
            or forks is None
            or len(forks) != 1
            or encoded.shared
            or self._on_loop_thread()
            or self._behind_pending(rank)
            or is_coroutine_function(fn)
            or is_async_execution(fn)
        ):
            return False
        lane = lanes.lane(rank, frame_nbytes(encoded.pieces))
        return lane is not None and lanes.send(lane, encoded)

    # -- on the loop -----------------------------------------------------------------------

    def start(self, encoded: EncodedRequest, waiter: Waiter, origin: int = 0) -> None:
        """Register the call and write its frame (on the loop thread); ``origin`` is the
        calling thread's ident."""
        e = encoded
        call = PendingCall(waiter, e, self.pending)
        if self.closed:
            call.fail(ClosedError(f"worker {self._name!r} is shut down"))
            return
        self.pending.add(call)
        self._counters.calls_sent += 1
        # The pipeline's ready stage may hold the frame (GPU work still filling its bytes).
        ready = None if e.observed is None else Pipeline.ready(*e.observed)
        frame = OutgoingFrame(e.rank, e.pieces, e.keep, e.forks, call, ready)
        key = (origin, e.rank)
        before = self._held.get(key)
        if before is not None and before.done():
            before = None
        if before is None and (ready is None or e.forks):
            self._frames.send(frame)
            return
        # Held aside until its GPU work is done (or behind this thread's request that is),
        # rather than at the head of the peer's queue: calls and replies sent meanwhile by
        # other threads do not wait for the GPU. A frame carrying RRef forks keeps its
        # place among the others (the reference counts follow the wire's order).
        task = self.loop.create_task(self._send_when_started(frame, before))
        self._held[key] = task
        task.add_done_callback(functools.partial(self._release_held, key))

    def _release_held(self, key: tuple[int, int], task: asyncio.Task[None]) -> None:
        if self._held.get(key) is task:
            del self._held[key]
        if not task.cancelled() and task.exception() is not None:
            _log.error("a held request could not be sent", exc_info=task.exception())

    async def _send_when_started(
        self, frame: OutgoingFrame, before: asyncio.Task[None] | None
    ) -> None:
        if before is not None:
            await asyncio.wait([before])
        ready = frame.ready
        try:
            if ready is not None:
                started = getattr(ready, "started", None)
                if started is not None:  # a frame in parts: its first part's bytes exist
                    await started()
                else:
                    await ready
                    frame = frame._replace(ready=None)
        except asyncio.CancelledError:
            self._unlend(frame.keep)  # shut down meanwhile: the call failed with it
            raise
        except Exception as exc:  # what held it back failed: the call fails with that
            failed: asyncio.Future[None] = self.loop.create_future()
            failed.set_exception(exc)
            frame = frame._replace(ready=failed)  # the links fail the call, as for any frame
        self._frames.send(frame)

    def cancel(self, call_id: int) -> None:
        """Give up on ``call_id`` (the caller was cancelled) and tell the callee."""
        call = self.pending.pop(call_id)
        if call is None:
            return
        self._counters.calls_cancelled += 1
        call.fail(asyncio.CancelledError())
        self._frames.cancel(call.peer, call_id)

    def expire(self, call_id: int) -> None:
        """The timeout of ``call_id`` passed: it fails, and the callee is told."""
        call = self.pending.pop(call_id)
        if call is None:
            return
        self._counters.calls_timed_out += 1
        request = call.request
        callee = self._directory.addresses[request.rank].name
        call.fail(RpcTimeoutError(callee, request.target, request.timeout))
        self._frames.cancel(request.rank, call_id)

    def on_reply(self, fields: list[Any], frame: Frame) -> None:
        call = self.pending.pop(fields[1])
        if call is None:
            return  # timed out or cancelled meanwhile
        observed = call.request.observed
        policy = None
        if observed is not None:  # what the hooks see: its policy, and its size
            outgoing = observed[1]
            policy, outgoing.reply_nbytes = outgoing.reply_policy, frame.nbytes
        try:
            headers = optional_headers(fields, 2)
            value = self._serializer.loads(
                frame.payload, frame.segments, context=call.peer, policy=policy
            )
        except Exception as exc:
            self._counters.calls_failed += 1
            call.fail(exc)
            return
        call.resolve(value, headers)

    def on_error(self, fields: list[Any], frame: Frame) -> None:
        call = self.pending.pop(fields[1])
        if call is None:
            return
        self._counters.calls_failed += 1
        observed = call.request.observed
        if observed is not None:
            observed[1].reply_nbytes = frame.nbytes
        call.fail(unpack_exception(bytes(frame.payload)), optional_headers(fields, 2))

    def fail_peer(self, rank: int, error: PeerLostError, sent_on: object = None) -> None:
        """Fail the calls to ``rank`` (only those written on ``sent_on``, if given)."""
        call: PendingCall | None = None
        for call in self.pending.pop_peer(rank, sent_on):
            self._counters.calls_failed += 1
            call.fail(own_copy(error))  # one error, raised by each caller: a copy each
        # A traceback made in a hook the calls ran keeps this frame: not the last call.
        call = None

    def close(self) -> None:
        """No more calls; those still pending fail."""
        self.closed = True
        held, self._held = self._held, {}
        for task in held.values():
            task.cancel()
        for call in self.pending.pop_all():
            call.fail(ClosedError(f"worker {self._name!r} shut down before the reply came"))

    def __len__(self) -> int:
        return len(self.pending)
