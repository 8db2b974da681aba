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
import contextlib
import itertools
import logging
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.errors import (
    AuthenticationError,
    BadDestinationError,
    ClosedError,
    ConnectionLostError,
    InitError,
    PeerLostError,
    RemoteProtocolError,
    RpcTimeoutError,
    ShutdownError,
    UnknownWorkerError,
)
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.handshake import pre_auth_decoder
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT, RpcBackendOptions, WorkerInfo
from asyncrpc.protocol.reflog import Transfer
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, encode_frame
from asyncrpc.protocol.wire.messages import (
    Auth,
    CallMode,
    Cancel,
    Goodbye,
    Hello,
    HelloReply,
    Kind,
    Ping,
    Pong,
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
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.group.rendezvous import StoreGroup, join_group
from asyncrpc.runtime.group.shutdown import GracefulShutdown
from asyncrpc.runtime.metrics import Counters, LagProbe, RateLimitedLog
from asyncrpc.runtime.net.heartbeat import Heartbeat, Watched
from asyncrpc.runtime.net.links import Links
from asyncrpc.runtime.net.loopback import LoopbackConnection
from asyncrpc.runtime.net.peers import GOODBYE_REASON, PeerTable
from asyncrpc.runtime.net.tls import TlsContexts, tls_contexts
from asyncrpc.runtime.net.transport import Connection, start_server, start_unix_server
from asyncrpc.runtime.services import RRefFactory, RRefService
from asyncrpc.runtime.shm.shm import SHM_TAG_PREFIX, SharedMemory
from asyncrpc.runtime.threadpool import WorkerPool

__all__ = ["Agent", "EncodedRequest"]


# A request pickled and framed on the calling thread: its call id, the function's name,
# the frame's pieces, what must live until they are written, and the pipeline hooks it
# went through with their view of it (None when no hook was active).
EncodedRequest = tuple[
    int, str, list[Any], object, tuple[tuple[CallHook, ...], OutgoingCall] | None,
    list[Transfer] | None,
]  # fmt: skip

_log = logging.getLogger("asyncrpc.runtime.agent")


class Agent:
    """One worker of an RPC group. Create it with ``await Agent.start(...)`` on its loop."""

    def __init__(
        self, name: str, options: RpcBackendOptions, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.name = name
        self.options = options
        self.loop = loop
        self.loop_thread_id = threading.get_ident()
        self.rank = -1
        self.world_size: int | None = 0  # None: a dynamic group (members come and go)
        self.counters = Counters()
        self._auth_log = RateLimitedLog(_log, interval=10.0)
        self.pending = PendingCalls(loop, self._expire)
        self.calls = self.pending  # what the links ask of the calls they carry
        self._call_ids = itertools.count(1)
        self.shm = SharedMemory(
            loop, options.shm_threshold, options.shm_arena_bytes, self._shares_memory,
            self._send_control,
        )  # fmt: skip
        # RRefs inside payloads become forks (see asyncrpc/rref/context.py); large tensors
        # for a peer on this host may go through shared memory (asyncrpc/runtime/shm/shm.py).
        self.serializer = Serializer(
            persistent_dump=self._dump_rref,
            persistent_load=self._load_rref,
            place=self.shm.place if options.shared_memory else None,
        )
        self.pool = WorkerPool(options.num_worker_threads, loop, name, options.max_worker_threads)
        self.pipeline = Pipeline()
        self.links = Links(self)
        self.dispatcher = Dispatcher(
            name, loop, self.pool, self.serializer, self.write, self.reply_device_map,
            self.counters, self.pipeline, options.print_errors,
        )  # fmt: skip
        self.lag = LagProbe(loop)
        self.heartbeat = Heartbeat(
            loop, options.heartbeat_interval, options.heartbeat_timeout,
            lambda: self._connections, self.links.ping, self._silent, self.links.ask_acks,
        )  # fmt: skip
        self.peers: PeerTable | None = None
        self.group: StoreGroup | None = None
        self.addresses: dict[int, PeerAddress] = {}
        self.directory = Directory(self.addresses, None)
        self._early_hellos: list[tuple[Connection, Hello]] = []
        self._connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._unix_server: asyncio.AbstractServer | None = None
        self.closed = False
        self._loopback: LoopbackConnection | None = None
        self.tls: TlsContexts | None = None
        # Created once the rank is known (after the rendezvous).
        self.rrefs: RRefService | None = None

    # -- start -----------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        name: str,
        rank: int,
        world_size: int | None,
        options: RpcBackendOptions,
        register: Callable[[Agent], None] | None = None,
        rrefs: RRefFactory | None = None,
        hooks: Sequence[CallHook] = (),
    ) -> Agent:
        """Listen, rendezvous and return a ready agent on the running loop.

        ``register`` runs on the loop right after joining, before any request can be
        served, so the agent is already "current" when the first request arrives.
        ``rrefs`` builds the RRef service once the rank is known (without it, requests in
        REMOTE mode and RRefs in payloads are refused); ``hooks`` start the call pipeline.
        Cancelling the start closes whatever was opened.

        Raises:
            InitError: the rendezvous failed (duplicates, timeout, bad arguments).
        """
        agent = cls(name, options, asyncio.get_running_loop())
        for hook in hooks:
            agent.pipeline.add(hook)
        try:
            await agent._join(rank, world_size, rrefs)
            if register is not None:
                register(agent)
        except BaseException:
            await agent._close_transports(graceful=False)
            agent.pool.shutdown()
            raise
        set_default_callback_loop(agent.loop, agent.loop_thread_id)
        agent.lag.start()
        agent.heartbeat.start()
        return agent

    async def _join(self, rank: int, world_size: int | None, rrefs: RRefFactory | None) -> None:
        options = self.options
        if options.tls_cert is not None and options.tls_key is not None and options.tls_ca:
            self.tls = tls_contexts(options.tls_cert, options.tls_key, options.tls_ca)
        self._server, port = await start_server(
            options.listen_host,
            self._accept,
            options.listen_port,
            ssl_context=self.tls.server if self.tls else None,
        )
        unix_path = None
        if options.unix_sockets and self.tls is None and sys.platform == "linux":
            # Abstract namespace (leading NUL): nothing to clean up, even after a SIGKILL.
            unix_path = f"\0asyncrpc-{uuid.uuid4().hex}"
            self._unix_server = await start_unix_server(unix_path, self._accept)
        init_timeout = options.rpc_timeout if options.rpc_timeout > 0 else 300.0
        try:
            configured_key = auth.key_bytes(options.auth_key)
        except ValueError as exc:
            raise InitError(str(exc)) from None
        group, self.addresses, key = await self.loop.run_in_executor(
            None,
            join_group,
            options.init_method,
            self.name,
            rank,
            world_size,
            options.advertise_host or options.listen_host,
            options.advertise_port or port,
            init_timeout,
            options.device_maps,
            configured_key,
            unix_path,
        )
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.directory = Directory(self.addresses, group)
        self.rrefs = None if rrefs is None else rrefs(self)
        self.dispatcher.rrefs = self.rrefs
        self.peers = PeerTable(
            self.name, self.rank, self.addresses, self._dial, key, options.max_frame_size,
            self._refuse, ssl_context=self.tls.client if self.tls else None,
            host_id=self.addresses[self.rank].host_id if unix_path else None,
            on_adopted=self.links.on_adopted, on_declared_lost=self._on_declared_lost,
        )  # fmt: skip
        for conn, hello in self._early_hellos:
            if not conn.closed:
                self._on_hello(conn, hello)
        self._early_hellos.clear()

    def _new_connection(self, initiated: bool) -> Connection:
        # Until the peer proves the key: handshake frames only, small, one per read pass
        # (PeerTable.adopt lifts the limits), and a deadline for accepted connections.
        decoder = pre_auth_decoder(lambda nbytes, tag: self._allocate(conn, nbytes, tag))
        conn = Connection(self, decoder, initiated=initiated)
        self._connections.add(conn)
        self.counters.connections_opened += 1
        if not initiated:
            self.loop.call_later(self.options.handshake_timeout, self._handshake_deadline, conn)
        return conn

    def _allocate(self, conn: Connection, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """Receive memory for a segment: a fresh buffer, or the sender's shared chunk."""
        if tag.startswith(SHM_TAG_PREFIX):
            return self.shm.allocate(conn.peer, nbytes, tag)
        return self.serializer.allocate(nbytes, tag)

    def _shares_memory(self, rank: int) -> bool:
        """May ``rank`` and this worker share memory? (Same host, allowed by the options.)"""
        address, mine = self.addresses.get(rank), self.addresses.get(self.rank)
        return (
            self.options.shared_memory
            and self.tls is None
            and sys.platform == "linux"
            and rank != self.rank
            and address is not None
            and mine is not None
            and bool(address.host_id)
            and address.host_id == mine.host_id
        )

    def _send_control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        """Write a bookkeeping frame to ``rank``: if it is connected, or else ``connect``."""
        if connect:
            self.send_to(rank, pieces)
            return
        peer = self.peers.peers.get(rank) if self.peers is not None else None
        if peer is not None and peer.conn is not None and not peer.conn.closed:
            self.write(peer.conn, pieces)

    def _handshake_deadline(self, conn: Connection) -> None:
        # Idle, or stalled in the middle of its Hello or Auth: closed either way.
        if conn.peer is None and not conn.closed:
            self.counters.handshake_timeouts += 1
            limit = self.options.handshake_timeout
            self._refuse(
                conn, AuthenticationError(f"no authenticated handshake within {limit:g} s")
            )

    def _silent(self, conn: Watched, seconds: float) -> None:
        assert isinstance(conn, Connection)
        self.counters.silent_connections += 1
        reason = f"no sign of life for {seconds:.1f} s"
        if conn.mid_frame:
            self.counters.stalled_frames += 1
            reason += " (in the middle of a frame)"
        if conn.peer is not None and self.peers is not None:
            # Evidence that the peer is gone, not only this connection: declared lost.
            name = self.addresses[conn.peer].name
            self.peers.declare_lost(conn.peer, PeerLostError(name, reason))
        conn.abort(ConnectionLostError(reason))

    def _refuse(self, conn: Connection, error: AuthenticationError) -> None:
        """A connection failed to authenticate: count it, log it (rate-limited), close it."""
        self.counters.auth_failures += 1
        self._auth_log.warning("worker %r refused a connection: %s", self.name, error)
        conn.abort(error)

    def _accept(self) -> Connection:
        return self._new_connection(False)

    def _dial(self, initiated: bool) -> Connection:
        return self._new_connection(initiated)

    def _dump_rref(self, obj: object, dest: object) -> tuple[Any, ...] | None:
        return None if self.rrefs is None else self.rrefs.dump(obj, dest)

    def _load_rref(self, pid: tuple[Any, ...], sender: object) -> object:
        if self.rrefs is None:
            raise RemoteProtocolError("an RRef arrived before this worker joined its group")
        return self.rrefs.load(pid, sender)

    # -- addressing ------------------------------------------------------------------------

    def resolve(self, to: str | int | WorkerInfo) -> int:
        """Return the rank of worker ``to`` (a name, a rank or a ``WorkerInfo``).

        Raises:
            UnknownWorkerError: no such worker in the group.
        """
        who = self._destination(to)
        rank = self.directory.known(who)
        if rank is None and self.directory.dynamic:
            # A member that joined after this one: read in the store, on the calling
            # thread. On the loop thread (a sync-style call from a coroutine) that is a
            # short blocking read, once per newcomer; ``call`` looks up off the loop.
            rank = self.directory.lookup(who)
        if rank is None:
            raise UnknownWorkerError(to, tuple(self.directory.ranks_by_name))
        return rank

    def _destination(self, to: str | int | WorkerInfo) -> str | int:
        if isinstance(to, WorkerInfo):
            return to.name
        if isinstance(to, str) or (isinstance(to, int) and not isinstance(to, bool)):
            return to
        name = getattr(to, "name", None)  # torch's WorkerInfo
        if not isinstance(name, str):
            raise BadDestinationError(to, tuple(self.directory.ranks_by_name))
        return name

    def worker_info(self, rank: int) -> WorkerInfo:
        """Raises: UnknownWorkerError: no worker has ``rank`` (dynamic: none in the store)."""
        if rank not in self.addresses and self.directory.lookup(rank) is None:
            raise UnknownWorkerError(rank, tuple(self.directory.ranks_by_name))
        return WorkerInfo(self.addresses[rank].name, rank)

    def worker_infos(self) -> list[WorkerInfo]:
        """The group's members by rank. Dynamic group: read in the store (blocking) when
        called off the loop thread, else the members this worker knows."""
        if self.directory.dynamic and threading.get_ident() != self.loop_thread_id:
            ranks = self.directory.current()
        else:
            ranks = sorted(dict(self.addresses))
        return [self.worker_info(r) for r in ranks]

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
        maps = self.options.device_maps
        return None if maps is None else maps.get(self.addresses[rank].name)

    def reply_device_map(self, rank: int) -> dict[str, str] | None:
        # A reply retraces the caller's device map backwards.
        maps = self.addresses[rank].device_maps if rank in self.addresses else None
        mine = None if maps is None else maps.get(self.name)
        return None if mine is None else {v: k for k, v in mine.items()}

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
        if rrefs is not None:
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
            self.links.undo_minted(rank)  # RRefs pickled before the failure: forked for nobody
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
            self.links.undo_minted(rank)
            raise
        forks = rrefs.take_minted() if rrefs is not None else None
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
            await self.directory.lookup_async(self._destination(to))  # off the loop
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
        """Write a frame to ``rank`` in order, connecting first if needed (see links.py)."""
        self.links.send_to(rank, pieces, call_id, keep, forks)

    def send_ref(self, rank: int, pieces: list[Any]) -> None:
        """Send a refcount frame, again on a new connection until acknowledged."""
        self.links.send_ref(rank, pieces)

    def _on_declared_lost(self, rank: int) -> None:
        """``rank`` is gone for good: fail everything bound for it, forget its RRefs."""
        lost = self.peers.peers[rank].lost if self.peers is not None else None
        assert lost is not None
        if self.closed or lost.reason == GOODBYE_REASON:  # a shutdown is no news
            _log.debug("worker %r: %s", self.name, lost)
        else:
            _log.warning("worker %r: %s", self.name, lost)
        self.links.forget(rank)
        for call in self.pending.pop_peer(rank):
            self.counters.calls_failed += 1
            call.fail(lost)
        self.dispatcher.cancel_peer(rank)
        self.shm.on_peer_lost(rank)
        if self.rrefs is not None:
            self.rrefs.on_peer_lost(rank)

    def write(
        self, conn: Connection, pieces: list[Any], keep: object = None,
        forks: list[Transfer] | None = None,
    ) -> None:  # fmt: skip
        """Write a frame on ``conn``; a closed connection drops it (the peer is gone)."""
        self.links.write(conn, pieces, keep, forks)

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
        if self.links.waiting_for_connection(rank):
            return  # its request still waits for the connection and will be skipped
        peer = self.peers.peers.get(rank) if self.peers is not None else None
        if rank == self.rank:
            self.loopback.send(encode_frame(Cancel(call_id).to_fields(), b""))
        elif peer is not None and peer.conn is not None and not peer.conn.closed:
            peer.conn.send(encode_frame(Cancel(call_id).to_fields(), b""))

    # -- receiving -------------------------------------------------------------------------

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        fields = frame.fields
        kind = fields[0] if fields else None
        # Hot path first: replies and requests on an established connection.
        if kind == Kind.REPLY and conn.peer is not None:
            self._on_reply(fields, frame)
            return
        try:
            message = decode_message(fields)
        except RemoteProtocolError as exc:
            self.counters.protocol_errors += 1
            conn.abort(exc)
            return
        if conn.peer is None:
            self._on_handshake(conn, message)
        elif isinstance(message, Request):
            self.counters.calls_received += 1
            self.dispatcher.on_request(conn, message, frame.payload, frame.segments)
        elif kind == Kind.ERROR:
            self._on_error(fields, frame)
        elif kind == Kind.CANCEL:
            self.dispatcher.on_cancel(conn.peer, fields[1])
        else:
            self._on_bookkeeping(conn, conn.peer, message)

    def _on_bookkeeping(self, conn: Connection, peer: int, message: Any) -> None:
        """The frames that are not calls: references, liveness, shared memory, goodbye."""
        if isinstance(message, RefMessage) and self.rrefs is not None:
            self.rrefs.on_message(peer, message)
        elif isinstance(message, Ping):
            self.write(conn, encode_frame(Pong().to_fields(), b""))
        elif isinstance(message, Pong):
            # Its bytes were the sign of life the heartbeat looks for; it also acknowledges
            # the refcount frames sent before its Ping.
            self.links.ponged(conn, peer)
        elif isinstance(message, ShmMessage):
            self.shm.on_message(peer, message)
        elif isinstance(message, Goodbye):
            conn.goodbye = True
        else:
            self.counters.protocol_errors += 1
            conn.abort(RemoteProtocolError(f"unexpected {type(message).__name__} after handshake"))

    def _on_handshake(self, conn: Connection, message: Any) -> None:
        # The handshake's rules are in asyncrpc/protocol/handshake.py; the peer table drives
        # that machine. Here: Hellos wait for the join, and other kinds never reach it.
        if isinstance(message, Hello):
            if self.peers is None:
                self._early_hellos.append((conn, message))
            else:
                self._on_hello(conn, message)
        elif isinstance(message, (HelloReply, Auth)) and self.peers is not None:
            self.peers.on_handshake(conn, message)
        else:
            self.counters.protocol_errors += 1
            conn.abort(RemoteProtocolError(f"{type(message).__name__} before the handshake"))

    def _on_hello(self, conn: Connection, hello: Hello) -> None:
        assert self.peers is not None
        if self.peer_known(hello.rank) or not self.directory.dynamic:
            self.peers.on_handshake(conn, hello)
        else:
            self.loop.create_task(self._on_newcomer_hello(conn, hello))

    async def _on_newcomer_hello(self, conn: Connection, hello: Hello) -> None:
        # A member that joined after this one dials: its address is in the store (it
        # publishes before it dials). A stranger's made-up rank costs one read, bounded by
        # the handshake deadline; it is refused by the handshake (no such member) or by its
        # proof.
        assert self.peers is not None
        with contextlib.suppress(UnknownWorkerError):  # then refused by the handshake
            await self.know_peer(hello.rank)
        if not conn.closed:
            self.peers.on_handshake(conn, hello)

    def peer_known(self, rank: int) -> bool:
        """Whether the peer table has ``rank``, adding it if its address is known (a member
        another thread looked up); on the loop thread."""
        assert self.peers is not None
        if rank in self.peers.peers:
            return True
        address = self.addresses.get(rank)
        if address is None or rank == self.rank:
            return False
        self.peers.add(address)
        return True

    async def know_peer(self, rank: int) -> None:
        """Make ``rank`` a peer, looking it up in a dynamic group's store if needed.

        Raises:
            UnknownWorkerError: no member has that rank.
        """
        if not self.peer_known(rank):
            await self.directory.lookup_async(rank)
            if not self.peer_known(rank):
                raise UnknownWorkerError(rank, tuple(self.directory.ranks_by_name))

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

    def on_protocol_error(self, conn: Connection, exc: BaseException) -> None:
        """The peer sent bytes that break the protocol; the connection is being aborted."""
        self.counters.protocol_errors += 1

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        """A connection closed. The calls written on it fail; its peer stays reachable (the
        next call dials again) unless it is declared lost (see ``peers.py``)."""
        self._connections.discard(conn)
        if self.peers is None:
            return
        rank = self.peers.on_lost(conn, exc)
        if rank is None:
            return
        self.counters.connections_lost += 1
        peer = self.peers.peers[rank]
        # Forks whose frames may have died with it: ask the peer (see reflog.py).
        self.links.on_lost(rank, conn, ask=peer.lost is None and not self.closed)
        error = peer.lost or PeerLostError(peer.address.name, f"connection lost ({exc or 'EOF'})")
        if peer.lost is None and not self.closed:
            _log.warning("worker %r: %s; the next call reconnects", self.name, error)
        # Calls written on it may or may not have run: they fail, typed; calls still
        # waiting for a connection are sent on the next one.
        for call in self.pending.pop_peer(rank, sent_on=conn):
            self.counters.calls_failed += 1
            call.fail(error)
        # Calls that came on it are cancelled (nobody reads their replies); remote()
        # requests run on: their value must still land here.
        self.dispatcher.cancel_connection(conn)
        # Shared memory ends with the connection: chunks lent on it are closed, not
        # reused, and the peer's mappings dropped; the next connection probes again.
        self.shm.on_peer_lost(rank)
        if peer.lost is None and not self.closed and peer.conn is None:
            # Dial again now, not at the next call: the link heals before it is needed, and
            # a dead peer is found (refused) and declared lost, which frees its RRefs.
            self.loop.create_task(self._redial(rank))

    async def _redial(self, rank: int) -> None:
        assert self.peers is not None
        try:
            await self.peers.connection(rank)
        except (ConnectionError, OSError) as exc:  # declared lost, or not reachable yet
            _log.debug("worker %r: redial of rank %d failed: %s", self.name, rank, exc)

    # -- stopping --------------------------------------------------------------------------

    @property
    def loopback(self) -> LoopbackConnection:
        """The connection for calls to self, made on first use."""
        if self._loopback is None:
            self._loopback = LoopbackConnection(
                self.rank, self.name, self.loop, self.serializer.allocate, self.on_frame
            )
        return self._loopback

    def calls_in_flight(self) -> int:
        return len(self.pending)

    def requests_running(self) -> int:
        return len(self.dispatcher)

    def is_lost(self, rank: int) -> bool:
        peers = self.peers
        return peers is not None and rank in peers.peers and peers.is_lost(rank)

    def probe(self, rank: int) -> None:
        """Dial ``rank`` unless connected or lost: a dead peer refuses and is declared lost."""
        peers = self.peers
        if peers is None or rank not in peers.peers:
            return
        peer = peers.peers[rank]
        if peer.lost is None and (peer.conn is None or peer.conn.closed) and not peer.dialing:
            self.loop.create_task(self._redial(rank))

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
        self.heartbeat.stop()
        if self._server is not None:
            self._server.close()
        if self._unix_server is not None:
            self._unix_server.close()
        goodbye = encode_frame(Goodbye("shutdown").to_fields(), b"")
        for conn in list(self._connections):
            if graceful and conn.peer is not None and not conn.closed:
                self.write(conn, goodbye)
            conn.close()
        for call in self.pending.pop_all():
            call.fail(ClosedError(f"worker {self.name!r} shut down before the reply came"))
        if self._loopback is not None:
            self._loopback.close()
        if self.rrefs is not None:
            self.rrefs.close()
        self.shm.close()
        await asyncio.sleep(0)  # let the transports flush and call connection_lost
        self.pool.shutdown()
        await self.pool.stopped(timeout=1.0)
        set_default_callback_loop(None, None)

    # -- introspection ---------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges of this worker (see ``asyncrpc.get_metrics``)."""
        # One snapshot: callers read metrics from their own thread while the loop thread
        # adds and removes connections (iterating the live set could fail mid-way).
        conns = list(self._connections)
        return {
            **self.counters.as_dict(),
            "pending_calls": len(self.pending),
            "running_requests": len(self.dispatcher),
            "bytes_in": sum(c.bytes_in for c in conns),
            "bytes_out": sum(c.bytes_out for c in conns),
            "open_connections": sum(1 for c in conns if c.peer is not None and not c.closed),
            "open_unix_connections": sum(
                1 for c in conns if c.peer is not None and not c.closed and c.is_unix
            ),
            "thread_pool_size": self.pool.size,
            "thread_pool_busy": self.pool.busy,
            "thread_pool_idle": self.pool.size - self.pool.busy,
            "thread_pool_threads": self.pool.threads,
            "thread_pool_blocked": self.pool.blocked,
            "thread_pool_refused": self.pool.refused,
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
            "lost_peers": sorted(
                p.address.name
                for p in (self.peers.peers.values() if self.peers else [])
                if p.lost is not None
            ),
            **self.metrics(),
            "unacked_ref_frames": self.links.unacked_frames(),
            **(self.rrefs.debug_info() if self.rrefs is not None else {}),
            **{k: v for hook in self.pipeline.hooks for k, v in hook.debug_info().items()},
        }
