"""The event-loop agent: one worker's peers, calls, dispatch and lifecycle (layer L2).

The agent lives on one asyncio loop (its own background thread for synchronous programs,
or the program's loop for asyncio ones) and owns all of the worker's state. Callers on
other threads pickle and frame their request on their own thread and hand the frame over
with one ``call_soon_threadsafe``; replies complete an ``asyncrpc.Future`` (thread side)
or an ``asyncio.Future`` (coroutines on the agent's loop). Every call, both ways, passes
through the agent's call ``pipeline`` (see ``asyncrpc/runtime/calls/pipeline.py``). RRefs live a
floor above: the agent reaches them through the ``RRefService`` its starter builds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.errors import (
    ClosedError,
    PeerLostError,
    RemoteProtocolError,
    RpcTimeoutError,
    ShutdownError,
)
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT, RpcBackendOptions, WorkerInfo
from asyncrpc.protocol.reflog import Transfer
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, encode_frame
from asyncrpc.protocol.wire.messages import (
    CallMode,
    Cancel,
    Kind,
    RefMessage,
    Request,
    ShmMessage,
    decode_message,
    optional_headers,
)
from asyncrpc.runtime import handoffs
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.pending import PendingCall, PendingCalls, describe_function
from asyncrpc.runtime.calls.pipeline import CallHook, OutgoingCall, Pipeline
from asyncrpc.runtime.future import Future, set_default_callback_loop
from asyncrpc.runtime.group.join import Group, join
from asyncrpc.runtime.group.shutdown import GracefulShutdown
from asyncrpc.runtime.metrics import Counters, LagProbe
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.network import Network
from asyncrpc.runtime.net.tls import tls_contexts
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.services import RRefFactory
from asyncrpc.runtime.shm.shm import SharedMemory
from asyncrpc.runtime.threadpool import WorkerPool

__all__ = ["Agent", "EncodedRequest"]


# A request pickled and framed on the calling thread: its call id, the function's name,
# the frame's pieces, what must live until they are written, and the pipeline hooks it
# went through with their view of it (None when no hook was active).
EncodedRequest = tuple[
    int, str, list[Any], object, tuple[tuple[CallHook, ...], OutgoingCall] | None,
    list[Transfer] | None,
]  # fmt: skip

_log = logging.getLogger(__name__)


def _never(rank: int) -> bool:
    return False


class Agent:
    """One worker of a joined group. Create it with ``await Agent.start(...)`` on its loop."""

    def __init__(
        self,
        group: Group,
        listener: Listener,
        options: RpcBackendOptions,
        loop: asyncio.AbstractEventLoop,
        rrefs: RRefFactory,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        self.group, self.options, self.loop = group, options, loop
        self.name, self.rank, self.world_size = group.name, group.rank, group.world_size
        self.addresses, self.directory = group.addresses, group.directory
        self.loop_thread_id = threading.get_ident()
        self.counters = Counters()
        self.closed = False
        self.pending = PendingCalls(loop, self._expire)
        self._call_ids = itertools.count(1)
        self.pool = WorkerPool(
            options.num_worker_threads, loop, self.name, options.max_worker_threads
        )
        self.pipeline = Pipeline()
        for hook in hooks:
            self.pipeline.add(hook)
        self.rrefs = rrefs(self)
        self.shm = SharedMemory(
            loop, options.shm_threshold, options.shm_arena_bytes,
            group.same_host if options.shared_memory else _never,
            self._send_control,
        )  # fmt: skip
        # RRefs inside payloads become forks (see asyncrpc/rref/context.py); large tensors
        # for a peer on this host may go through shared memory (asyncrpc/runtime/shm/).
        self.serializer = Serializer(
            persistent_dump=self.rrefs.dump,
            persistent_load=self.rrefs.load,
            place=self.shm.place if options.shared_memory else None,
        )
        self.network = Network(
            group, options, loop, self.counters, receiver=self, calls=self.pending,
            rrefs=self.rrefs, shm=self.shm, allocate=self.serializer.allocate, listener=listener,
        )  # fmt: skip
        self.dispatcher = Dispatcher(
            self.name, loop, self.pool, self.serializer, self.network.write,
            self.reply_device_map, self.counters, self.pipeline, self.rrefs, options.print_errors,
        )  # fmt: skip
        self.lag = LagProbe(loop)

    def _send_control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        self.network.send_control(rank, pieces, connect)  # shared memory's bookkeeping

    # -- start -----------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        name: str,
        rank: int,
        world_size: int | None,
        options: RpcBackendOptions,
        rrefs: RRefFactory,
        register: Callable[[Agent], None] | None = None,
        hooks: Callable[[Group], Sequence[CallHook]] | None = None,
    ) -> Agent:
        """Listen, join the group, then build the agent from it, on the running loop.

        Until the join the listener only parks what it accepts. ``register`` runs on the
        loop right after the agent is built, before any request can be served, so the
        agent is already "current" when the first request arrives. ``rrefs`` builds the
        RRef service; ``hooks`` the call pipeline's hooks. Cancelling the start closes
        whatever was opened.

        Raises:
            InitError: the rendezvous failed (duplicates, timeout, bad arguments).
        """
        tls = None
        if options.tls_cert is not None and options.tls_key is not None and options.tls_ca:
            tls = tls_contexts(options.tls_cert, options.tls_key, options.tls_ca)
        listener = await Listener.start(
            options.listen_host, options.listen_port, tls, options.unix_sockets
        )
        try:
            group = await join(name, rank, world_size, options, listener, tls)
            made = () if hooks is None else hooks(group)
            agent = cls(group, listener, options, asyncio.get_running_loop(), rrefs, made)
        except BaseException:
            listener.close()
            raise
        try:
            if register is not None:
                register(agent)
        except BaseException:
            await agent._close_transports(graceful=False)
            raise
        set_default_callback_loop(agent.loop, agent.loop_thread_id)
        agent.lag.start()
        agent.network.start()
        return agent

    # -- addressing (the group's directory) ------------------------------------------------

    def resolve(self, to: str | int | WorkerInfo) -> int:
        """Return the rank of worker ``to`` (a name, a rank or a ``WorkerInfo``).

        Raises:
            UnknownWorkerError: no such worker in the group.
        """
        return self.directory.resolve(to)

    def worker_info(self, rank: int) -> WorkerInfo:
        """Raises: UnknownWorkerError: no worker has ``rank`` (dynamic: none in the store)."""
        return self.directory.worker_info(rank)

    def worker_infos(self) -> list[WorkerInfo]:
        """The group's members by rank. Dynamic group: read in the store (blocking) when
        called off the loop thread, else the members this worker knows."""
        return self.directory.worker_infos(threading.get_ident() != self.loop_thread_id)

    def effective_timeout(self, timeout: float) -> float:
        """torch's rule: a negative timeout means the default, 0 means none (so does inf).

        Raises:
            ValueError: the timeout is NaN.
        """
        if math.isnan(timeout):
            raise ValueError("the timeout is NaN")
        if timeout < 0 or timeout == UNSET_RPC_TIMEOUT:
            return self.options.rpc_timeout
        return 0.0 if math.isinf(timeout) else timeout

    def request_device_map(self, rank: int) -> dict[str, str] | None:
        return self.directory.request_device_map(rank)

    def reply_device_map(self, rank: int) -> dict[str, str] | None:
        return self.directory.reply_device_map(rank, self.name)

    # -- calling ---------------------------------------------------------------------------

    def encode_request(
        self,
        rank: int,
        fn: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float,
        kind: str,
        mode: int = CallMode.CALL,
        register: Callable[[], tuple[tuple[int, int], tuple[int, int] | None]] | None = None,
        target: str | None = None,
    ) -> EncodedRequest:
        """Pickle and frame a request on the calling thread, through the call pipeline.

        Args:
            kind: torch's name of the call's mode for the hooks: "sync", "async", "remote".
            register: for ``remote()``, makes the RRef and fork ids once the payload is
                pickled and the hooks have run (so a failure leaves no RRef state).
            target: the name the hooks and errors use (default: the function's).

        Raises:
            SerializationError: the function or an argument cannot be pickled.
        """
        self._check_open()
        hooks = self.pipeline.active_hooks()
        call = None
        target = describe_function(fn) if target is None else target
        if hooks:
            call = OutgoingCall(
                kind, self.name, self.addresses[rank].name, rank, fn, target, args, kwargs
            )
        rrefs = self.rrefs
        rrefs.take_minted()  # a pickling that failed elsewhere on this thread may leave some
        try:
            payload, segments, keep = self.serializer.dumps(
                (fn, args, kwargs),
                context=rank,
                device_map=self.request_device_map(rank),
                tensors=None if call is None else call.tensors,
                grads=None if call is None else call.grads,
            )
        except BaseException:
            self.network.links.undo_minted(
                rank
            )  # RRefs pickled before the failure: forked for nobody
            raise
        call_id = next(self._call_ids)
        headers = None
        try:
            if call is not None:
                call.call_id = call_id
                Pipeline.outgoing(hooks, call)
                headers = call.headers or None
            rref_id, fork_id = register() if register is not None else (None, None)
            request = Request(call_id, timeout, mode, target, rref_id, fork_id, headers)
            pieces = encode_frame(request.to_fields(), payload, segments)
        except BaseException:
            self.shm.unlend(keep)  # no frame: no peer will give its shared chunks back
            self.network.links.undo_minted(rank)
            raise
        forks = rrefs.take_minted()
        return call_id, target, pieces, keep, None if call is None else (hooks, call), forks

    def call_future(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        kind: str = "async", target: str | None = None,
    ) -> Future[Any]:  # fmt: skip
        """Start a call from any thread and return its ``asyncrpc.Future``."""
        rank = self.resolve(to)
        timeout = self.effective_timeout(timeout)
        call_id, target, pieces, keep, observed, forks = self.encode_request(
            rank, fn, args, kwargs, timeout, kind, target=target
        )
        future: Future[Any] = Future(loop=self.loop)
        future._cancel_hook = lambda: self.loop.call_soon_threadsafe(self.cancel_call, call_id)
        call = PendingCall(future, rank, target, timeout)
        call.keepalive, call.observed, call.forks = keep, observed, forks
        self.run_on_loop(self.begin_call, call_id, call, pieces)
        return future

    async def call(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        """Call on the agent's own loop; cancelling the awaiting task cancels the remote work."""
        if self.directory.dynamic:
            await self.directory.lookup_async(self.directory.destination(to))  # off the loop
        rank = self.resolve(to)
        timeout = self.effective_timeout(timeout)
        call_id, target, pieces, keep, observed, forks = self.encode_request(
            rank, fn, args, kwargs, timeout, "async"
        )
        waiter: asyncio.Future[Any] = self.loop.create_future()
        call = PendingCall(waiter, rank, target, timeout)
        call.keepalive, call.observed, call.forks = keep, observed, forks
        self.begin_call(call_id, call, pieces)
        try:
            return await waiter
        except asyncio.CancelledError:
            self.cancel_call(call_id)
            raise

    def send_remote(
        self, rank: int, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        register: Callable[[], tuple[tuple[int, int], tuple[int, int] | None]],
        target: str | None = None,
    ) -> Future[Any] | None:  # fmt: skip
        """Send a ``remote()`` request from any thread; the owner keeps the value.

        ``register`` makes the RRef id and the caller's fork id (None when the owner is
        this worker: its value then never leaves the process).

        Without pipeline hooks nothing waits for it here (the RRef protocol confirms it).
        With hooks, the owner acknowledges the end of the function, and a pending call
        tells the hooks.

        Returns:
            With hooks, the future of that acknowledgement (done after the hooks were
            told); else None.

        Raises:
            SerializationError: the function or an argument cannot be pickled.
        """
        call_id, target, pieces, keep, observed, forks = self.encode_request(
            rank, fn, args, kwargs, timeout, "remote", CallMode.REMOTE, register, target
        )
        if observed is None:
            self.run_on_loop(self.send_to, rank, pieces, 0, keep, forks)
            return None
        acknowledged: Future[Any] = Future(loop=self.loop)
        call = PendingCall(acknowledged, rank, target, timeout)
        call.keepalive, call.observed, call.forks = keep, observed, forks
        self.run_on_loop(self.begin_call, call_id, call, pieces)
        return acknowledged

    def run_on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the agent's loop: now if this is the loop thread."""
        if threading.get_ident() == self.loop_thread_id:
            fn(*args)
        else:
            handoffs.count("thread_to_loop")
            self.loop.call_soon_threadsafe(fn, *args)

    def begin_call(self, call_id: int, call: PendingCall, pieces: list[Any]) -> None:
        """Register ``call`` and write its frame (on the loop thread)."""
        if self.closed:
            call.fail(ClosedError(f"worker {self.name!r} is shut down"))
            return
        self.pending.add(call_id, call)
        self.counters.calls_sent += 1
        self.send_to(call.peer, pieces, call_id, call.keepalive, call.forks)

    def send_to(
        self, rank: int, pieces: list[Any], call_id: int = 0, keep: object = None,
        forks: list[Transfer] | None = None,
    ) -> None:  # fmt: skip
        """Write a frame to ``rank`` in order, connecting first if needed (see net/links.py)."""
        self.network.links.send_to(rank, pieces, call_id, keep, forks)

    def send_ref(self, rank: int, pieces: list[Any]) -> None:
        """Send a refcount frame, again on a new connection until acknowledged."""
        self.network.links.send_ref(rank, pieces)

    def _expire(self, call_id: int) -> None:
        call = self.pending.pop(call_id)
        if call is None:
            return
        self.counters.calls_timed_out += 1
        call.fail(RpcTimeoutError(self.addresses[call.peer].name, call.target, call.timeout))
        self._send_cancel(call.peer, call_id)

    def cancel_call(self, call_id: int) -> None:
        """Give up on ``call_id`` (the caller was cancelled) and tell the callee."""
        call = self.pending.pop(call_id)
        if call is None:
            return
        self.counters.calls_cancelled += 1
        call.fail(asyncio.CancelledError())
        self._send_cancel(call.peer, call_id)

    def _send_cancel(self, rank: int, call_id: int) -> None:
        # Its request may still wait for the connection: then it is skipped, no Cancel.
        self.network.send_if_connected(rank, encode_frame(Cancel(call_id).to_fields(), b""))

    # -- receiving (asyncrpc.runtime.net.network.Receiver) ---------------------------------

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """Route an authenticated frame: calls and replies, references, shared memory."""
        fields = frame.fields
        kind = fields[0] if fields else None
        if kind == Kind.REPLY:  # the hot path first
            self._on_reply(fields, frame)
            return
        try:
            message = decode_message(fields)
        except RemoteProtocolError as exc:
            self.counters.protocol_errors += 1
            conn.abort(exc)
            return
        peer = conn.peer
        assert peer is not None  # the network hands over authenticated frames only
        if isinstance(message, Request):
            self.counters.calls_received += 1
            self.dispatcher.on_request(conn, message, frame.payload, frame.segments)
        elif kind == Kind.ERROR:
            self._on_error(fields, frame)
        elif kind == Kind.CANCEL:
            self.dispatcher.on_cancel(peer, fields[1])
        elif isinstance(message, RefMessage):
            self.rrefs.on_message(peer, message)
        elif isinstance(message, ShmMessage):
            self.shm.on_message(peer, message)
        else:
            self.counters.protocol_errors += 1
            conn.abort(RemoteProtocolError(f"unexpected {type(message).__name__} after handshake"))

    def _on_reply(self, fields: list[Any], frame: Frame) -> None:
        call = self.pending.pop(fields[1])
        if call is None:
            return  # timed out or cancelled meanwhile
        grads: list[Any] | None = None if call.observed is None else []
        try:
            headers = optional_headers(fields, 2)
            value = self.serializer.loads(
                frame.payload, frame.segments, context=call.peer, grads=grads
            )
        except Exception as exc:
            self.counters.calls_failed += 1
            call.fail(exc)
            return
        call.resolve(value, headers, grads)

    def _on_error(self, fields: list[Any], frame: Frame) -> None:
        call = self.pending.pop(fields[1])
        if call is None:
            return
        self.counters.calls_failed += 1
        call.fail(unpack_exception(bytes(frame.payload)), optional_headers(fields, 2))

    def on_connection_lost(self, rank: int, conn: Connection, error: PeerLostError) -> None:
        """Calls written on ``conn`` may or may not have run: they fail, typed; calls still
        waiting for a connection are sent on the next one."""
        for call in self.pending.pop_peer(rank, sent_on=conn):
            self.counters.calls_failed += 1
            call.fail(error)
        # Calls that came on it are cancelled (nobody reads their replies); remote()
        # requests run on: their value must still land here.
        self.dispatcher.cancel_connection(conn)
        # Shared memory ends with the connection: chunks lent on it are closed, not
        # reused, and the peer's mappings dropped; the next connection probes again.
        self.shm.on_peer_lost(rank)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good: fail everything bound for it, forget its RRefs."""
        for call in self.pending.pop_peer(rank):
            self.counters.calls_failed += 1
            call.fail(error)
        self.dispatcher.cancel_peer(rank)
        self.shm.on_peer_lost(rank)
        self.rrefs.on_peer_lost(rank)

    # -- stopping --------------------------------------------------------------------------

    def calls_in_flight(self) -> int:
        return len(self.pending)

    def requests_running(self) -> int:
        return len(self.dispatcher)

    def is_lost(self, rank: int) -> bool:
        return self.network.is_lost(rank)

    def probe(self, rank: int) -> None:
        """Dial ``rank`` unless connected or lost: a dead peer refuses and is declared lost."""
        self.network.probe(rank)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"worker {self.name!r} is shut down")

    async def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop this worker; see ``asyncrpc.shutdown``.

        Raises:
            ShutdownError: the graceful part failed (a peer died, or ``timeout`` ran out);
                this worker is stopped all the same.
        """
        limit = self.options.shutdown_timeout if timeout is None else timeout
        failure: ShutdownError | None = None
        if graceful:
            try:
                await GracefulShutdown(self).run(time.monotonic() + limit)
            except ShutdownError as exc:
                failure = exc
        await self._close_transports(graceful and failure is None)
        if failure is not None:
            raise failure

    async def _close_transports(self, graceful: bool) -> None:
        self.closed = True
        self.lag.stop()
        self.network.close(graceful)
        for call in self.pending.pop_all():
            call.fail(ClosedError(f"worker {self.name!r} shut down before the reply came"))
        self.rrefs.close()
        self.shm.close()
        await asyncio.sleep(0)  # let the transports flush and call connection_lost
        self.pool.shutdown()
        await self.pool.stopped(timeout=1.0)
        set_default_callback_loop(None, None)

    # -- introspection ---------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges of this worker (see ``asyncrpc.get_metrics``)."""
        pool = self.pool
        return {
            **self.counters.as_dict(),
            "pending_calls": len(self.pending),
            "running_requests": len(self.dispatcher),
            **self.network.metrics(),
            "thread_pool_size": pool.size,
            "thread_pool_busy": pool.busy,
            "thread_pool_idle": pool.size - pool.busy,
            "thread_pool_threads": pool.threads,
            "thread_pool_blocked": pool.blocked,
            "thread_pool_refused": pool.refused,
            "loop_lag_ms": round(self.lag.last_ms, 3),
            "loop_lag_max_ms": round(self.lag.max_ms, 3),
            **self.shm.stats(),
            # Work handed between threads, by kind, in this whole process (runtime/handoffs).
            **{f"handoffs_{kind}": n for kind, n in handoffs.snapshot().items()},
        }

    def debug_info(self) -> dict[str, Any]:
        """Metrics plus identity, peers and RRef bookkeeping (see ``asyncrpc.get_debug_info``)."""
        return {
            "name": self.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "rpc_timeout": self.options.rpc_timeout,
            "pending_by_peer": {
                self.addresses[r].name: n for r, n in self.pending.count_by_peer().items()
            },
            "lost_peers": self.network.lost_peers(),
            **self.metrics(),
            "unacked_ref_frames": self.network.links.unacked_frames(),
            **self.rrefs.debug_info(),
            **{k: v for hook in self.pipeline.hooks for k, v in hook.debug_info().items()},
        }
