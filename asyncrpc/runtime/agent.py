"""The agent: one worker of a joined group, wired from its parts (layer L2.5).

``Agent.start`` listens, joins the group (``group/join.py``) and only then builds the
agent from the ``Group`` it got: the network (``net/``), the outbox of outgoing calls and
the dispatcher of received ones (``calls/``), same-host memory (``shm/``), the thread pool,
the call pipeline's hooks and the RRef service of the floor above (behind the
``RRefService`` protocol). The agent owns them, routes the frames the network hands it,
tells the parts when a connection or a peer is lost, and stops them in order. It lives on
one asyncio loop: its own background thread for synchronous programs, or the program's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from asyncrpc.errors import PeerLostError, RemoteProtocolError, ShutdownError
from asyncrpc.protocol.options import RpcBackendOptions, WorkerInfo
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import Allocator, Frame
from asyncrpc.protocol.wire.messages import Kind, RefMessage, Request, ShmMessage
from asyncrpc.protocol.wire.stream import STREAM_KINDS
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.outbox import Outbox
from asyncrpc.runtime.calls.pending import PendingCalls
from asyncrpc.runtime.calls.pipeline import CallHook, Pipeline
from asyncrpc.runtime.calls.streams.hub import Streams
from asyncrpc.runtime.cuda.maps import DeviceMapHook, check_device_maps
from asyncrpc.runtime.cuda.staging import cuda_transfer
from asyncrpc.runtime.futures import set_default_callback_loop
from asyncrpc.runtime.group.join import Group, join
from asyncrpc.runtime.group.shutdown import GracefulShutdown, shutdown_limit
from asyncrpc.runtime.lanes.client import CallerLanes
from asyncrpc.runtime.lanes.handshake import LaneRoster
from asyncrpc.runtime.lanes.server import LaneReply, LaneServer, Serving
from asyncrpc.runtime.metrics import Counters, LagProbe
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.network import Network
from asyncrpc.runtime.net.tls import configured_tls
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.services import RRefFactory
from asyncrpc.runtime.shm.shm import SharedMemory
from asyncrpc.runtime.threads import handoffs
from asyncrpc.runtime.threads.pool import WorkerPool

__all__ = ["Agent"]


def _never(rank: int) -> bool:
    return False


def _staged_allocate(
    pinned: Callable[[int], tuple[object, memoryview]], plain: Allocator, nbytes: int, tag: str
) -> tuple[object, memoryview]:
    return pinned(nbytes) if tag.startswith("cuda") else plain(nbytes, tag)


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
        lane_server: LaneServer | None = None,
    ) -> None:
        self.group, self.options, self.loop = group, options, loop
        self.name, self.rank, self.world_size = group.name, group.rank, group.world_size
        self.addresses, self.directory = group.addresses, group.directory
        self.loop_thread_id = threading.get_ident()
        self.counters = Counters()
        self.pending = PendingCalls(loop, self._expire)
        self.pool = WorkerPool(
            options.num_worker_threads, loop, self.name, options.max_worker_threads
        )
        # Device maps ride on every agent (a callee applies its callers' reply maps); the
        # other hooks come from whoever starts the agent.
        transfer = self.cuda = cuda_transfer(options, group.same_host)
        self.pipeline = Pipeline([DeviceMapHook(options.device_maps, transfer), *hooks])
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
            discard=self.rrefs.undelivered,
            place=self.shm.place if options.shared_memory else None,
        )
        allocate = self.serializer.allocate
        if transfer is not None:  # segments bound for a GPU land in pinned memory
            allocate = partial(_staged_allocate, transfer.allocate, allocate)
        self.network = Network(
            group, options, loop, self.counters, receiver=self, calls=self.pending,
            rrefs=self.rrefs, shm=self.shm, allocate=allocate, listener=listener,
        )  # fmt: skip
        # Lanes (lanes/): calling threads' own connections for rpc_sync, and the threads
        # serving peers' lanes here. Their frames never use shared memory.
        lane_serializer = Serializer(persistent_dump=self.rrefs.dump,
                                     persistent_load=self.rrefs.load,
                                     discard=self.rrefs.undelivered)  # fmt: skip
        self.lanes = CallerLanes(
            (self.name, self.rank), self.addresses, group.host_id, group.key,
            options.max_frame_size, options.handshake_timeout, lane_serializer,
            small=options.shm_threshold if options.shared_memory else 1 << 20,
            enabled=options.sync_lanes > 0 and group.tls is None,
        )  # fmt: skip
        self.lane_server = lane_server
        self.outbox = Outbox(
            self.name, loop, self.pending, serializer=self.serializer, pipeline=self.pipeline,
            directory=self.directory, sender=self.network,
            unlend=self.shm.unlend, counters=self.counters,
            default_timeout=options.rpc_timeout, lanes=self.lanes,
        )  # fmt: skip
        # What the API and the RRef layer use, as the parts' own methods (no extra call on
        # the hot path): addressing, the ways in for calls, refcount frames, liveness.
        self.resolve, self.worker_info = self.directory.resolve, self.directory.worker_info
        self.call_future, self.call = self.outbox.call_future, self.outbox.call
        self.call_sync = self.outbox.call_sync
        self.send_remote, self.run_on_loop = self.outbox.send_remote, self.outbox.run_on_loop
        self.effective_timeout = self.outbox.effective_timeout
        self.send_ref, self.is_lost = self.network.send_ref, self.network.is_lost
        self.probe = self.network.probe  # dial unless connected or lost (shutdown)
        self.is_connected = self.network.peers.connected
        self.dispatcher = Dispatcher(
            self.name, loop, self.pool, self.serializer, self._write_reply, self.counters,
            self.pipeline, self.rrefs, options.print_errors,
        )  # fmt: skip
        # Streaming calls (calls/streams.py): the dispatcher starts their producers.
        self.write = self.network.write
        self.streams = Streams(self, self._send_control)
        self.dispatcher.streams = self.streams.producers
        self.lag = LagProbe(loop)
        if lane_server is not None:
            lane_server.serve(Serving(
                self.name, self.rank, group.key, options.max_frame_size,
                options.handshake_timeout, LaneRoster(self._member_name, self.is_lost),
                lane_serializer, self.pipeline, self.dispatcher, self.rrefs, self.run_on_loop,
                options.print_errors,
            ))  # fmt: skip

    def _write_reply(self, conn: Any, pieces: list[Any], keep: object, forks: Any) -> None:
        # A request a lane handed to the loop is answered through the lane's thread.
        if type(conn) is LaneReply:
            conn.deliver(pieces, keep, forks)
        else:
            self.network.write(conn, pieces, keep, forks)

    def _member_name(self, rank: int) -> str | None:
        address = self.addresses.get(rank)
        return None if address is None else address.name

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
        if options.device_maps or options.devices:  # as torch checks them, before joining
            import torch

            devices = torch.cuda.device_count()
            check_device_maps(name, options.device_maps, options.devices, devices)
        tls = configured_tls(options.tls_cert, options.tls_key, options.tls_ca)
        listener = await Listener.start(
            options.listen_host, options.listen_port, tls, options.unix_sockets
        )
        lanes = None
        try:
            if options.sync_lanes and tls is None:
                lanes = LaneServer.listen(
                    options.listen_host, options.unix_sockets, options.sync_lanes
                )
            where = (None, None) if lanes is None else (lanes.port, lanes.path)
            group = await join(name, rank, world_size, options, listener, tls, where)
            made = () if hooks is None else hooks(group)
            loop = asyncio.get_running_loop()
            agent = cls(group, listener, options, loop, rrefs, made, lanes)
        except BaseException:
            listener.close()
            if lanes is not None:
                lanes.close()
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

    def worker_infos(self) -> list[WorkerInfo]:
        """The group's members by rank. Dynamic group: read in the store (blocking) when
        called off the loop thread, else the members this worker knows."""
        return self.directory.worker_infos(threading.get_ident() != self.loop_thread_id)

    # -- calling (the outbox) ---------------------------------------------------------------

    def _expire(self, call_id: int) -> None:
        self.outbox.expire(call_id)  # a timeout passed (rare: no hot path)

    # -- receiving (asyncrpc.runtime.net.network.Receiver) ---------------------------------

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """Route an authenticated frame: calls and replies, references, shared memory."""
        fields = frame.fields
        kind = fields[0] if fields else None
        if kind == Kind.REPLY:  # the hot path first
            self.outbox.on_reply(fields, frame)
            return
        if type(kind) is int and kind in STREAM_KINDS:
            self.streams.on_frame(conn, frame)
            return
        message = self.network.decode(conn, fields)
        if message is None:
            return
        peer = conn.peer
        assert peer is not None  # the network hands over authenticated frames only
        if isinstance(message, Request):
            self.counters.calls_received += 1
            self.dispatcher.on_request(conn, message, frame.payload, frame.segments)
        elif kind == Kind.ERROR:
            self.outbox.on_error(fields, frame)
        elif kind == Kind.CANCEL:
            self.dispatcher.on_cancel(peer, fields[1])
        elif isinstance(message, RefMessage):
            self.rrefs.on_message(peer, message)
        elif isinstance(message, ShmMessage):
            self.shm.on_message(peer, message)
        else:
            self.counters.protocol_errors += 1
            conn.abort(RemoteProtocolError(f"unexpected {type(message).__name__} after handshake"))

    def on_connection_lost(self, rank: int, conn: Connection, error: PeerLostError) -> None:
        """Calls written on ``conn`` may or may not have run: they fail, typed; calls still
        waiting for a connection are sent on the next one."""
        self.outbox.fail_peer(rank, error, sent_on=conn)
        # Calls that came on it are cancelled (nobody reads their replies); remote()
        # requests run on: their value must still land here.
        self.dispatcher.cancel_connection(conn)
        self.streams.on_connection_lost(conn)  # streams produced for it stop
        # Shared memory ends with the connection: chunks lent on it are closed, not
        # reused, and the peer's mappings dropped; the next connection probes again.
        self.shm.on_peer_lost(rank)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good: fail everything bound for it, forget its RRefs."""
        self.outbox.fail_peer(rank, error)
        self.dispatcher.cancel_peer(rank)
        self.streams.on_peer_lost(rank)
        self.shm.on_peer_lost(rank)
        self.rrefs.on_peer_lost(rank)
        self.lanes.on_peer_lost(rank, error)
        if self.lane_server is not None:
            self.lane_server.on_peer_lost(rank)
        if self.cuda is not None:  # CUDA IPC memory it held is dropped on its behalf
            self.cuda.on_peer_lost(rank)

    # -- stopping --------------------------------------------------------------------------

    def calls_in_flight(self) -> int:
        return len(self.pending) + self.lanes.in_flight

    def requests_running(self) -> int:
        running = len(self.dispatcher)
        return running if self.lane_server is None else running + self.lane_server.running

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    async def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop this worker; see ``asyncrpc.shutdown``.

        Raises:
            ShutdownError: the graceful part failed (the store's host died, or ``timeout``
                ran out: ``ShutdownTimeoutError``), or workers died and ``lost_workers``
                is "error" (``WorkersLostError``); this worker is stopped all the same.
        """
        limit = shutdown_limit(self.options.shutdown_timeout if timeout is None else timeout)
        self.network.leaving = True  # peers that go away now are not "reconnected" in logs
        failure: ShutdownError | None = None
        rounds = GracefulShutdown(self)
        # This worker reads no more: the streams it consumes end now. Those it produces are
        # not outstanding work (an endless one would hold the barrier) but go on while the
        # barrier waits: a worker that calls shutdown() right after joining, torch's way
        # of serving until everybody is done, still serves streams. They end when their
        # consumers close them (a consumer's own shutdown does) or when this worker stops.
        self.streams.close_consumers()
        for hook in self.pipeline.hooks:
            hook.flush()
        if graceful:
            try:
                await rounds.run(limit)
            except ShutdownError as exc:
                failure = exc
        # A graceful shutdown says Goodbye even when it failed (a peer died, or the time ran
        # out): this worker is leaving all the same, and its peers should learn it is gone
        # (calls to it fail with PeerLostError) rather than redial a closed listener.
        await self._close_transports(graceful)
        if failure is not None:
            raise failure
        rounds.report_dead(self.options.lost_workers)

    async def _close_transports(self, graceful: bool) -> None:
        self.lag.stop()
        self.network.close(graceful)
        self.streams.close_all()
        self.outbox.close()
        self.rrefs.close()
        self.shm.close()
        self.lanes.close()
        if self.lane_server is not None:
            self.lane_server.close()
        await asyncio.sleep(0)  # let the transports flush and call connection_lost
        self.pool.shutdown()
        await self.pool.stopped(timeout=1.0)
        set_default_callback_loop(None, None)

    # -- introspection ---------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges of this worker (see ``asyncrpc.get_metrics``)."""
        figures: dict[str, Any] = {
            **self.counters.as_dict(),
            "pending_calls": len(self.pending),
            "running_requests": self.requests_running(),
            **self.network.metrics(),
            **self.pool.stats(),
            "loop_lag_ms": round(self.lag.last_ms, 3),
            "loop_lag_max_ms": round(self.lag.max_ms, 3),
            **self.shm.stats(),
            **self.streams.stats(),
            # Work handed between threads, by kind, in this whole process (runtime/handoffs).
            **{f"handoffs_{kind}": n for kind, n in handoffs.snapshot().items()},
        }
        # Calls, replies and bytes count the lanes' too; their own figures are lanes_*.
        for part in (self.lanes, self.lane_server):
            for key, value in ({} if part is None else part.stats()).items():
                figures[key] = figures.get(key, 0) + value if not key.startswith("lane") else value
        return figures

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
