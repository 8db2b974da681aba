"""The agent: one worker of a joined group, built from its parts (layer L2.5).

``Agent.start`` listens, joins the group (``group/join.py``) and only then builds the
agent from the ``Group`` it got, each part from the few ports it uses (``ports.py``), in
the order they use each other: the loop and its pool; the network (``net/``, the
``Frames`` port); the RRef layer's fork bookkeeping (built by the floor above through a
factory: everything that pickles needs it); the serializer; the outbox (``calls/``, the
``Calls`` port); the stream producers and the dispatcher; then the features
(``feature.py``): streams, CUDA, lanes, and those of the floors above (RRefs, profiling,
distributed autograd), built from ``Ports``. The agent owns them, routes each frame the
network hands it by its kind, tells the parts and every feature when a connection or a
peer is lost, and stops them in order. It lives on one asyncio loop: its own background
thread for synchronous programs, or the program's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from asyncrpc.errors import PeerLostError, RemoteProtocolError, ShutdownError
from asyncrpc.protocol.options import RpcBackendOptions, WorkerInfo
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.serde.buffers import ReceiveBuffers
from asyncrpc.protocol.wire import Frame
from asyncrpc.protocol.wire.messages import BarrierOpened, Cancel, Kind, Request, decode_message
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.outbox import Outbox
from asyncrpc.runtime.calls.pipeline import Pipeline
from asyncrpc.runtime.calls.streams.hub import StreamHub
from asyncrpc.runtime.calls.streams.producer import Producers
from asyncrpc.runtime.cuda.feature import CudaFeature
from asyncrpc.runtime.cuda.maps import check_device_maps
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.futures import set_default_callback_loop
from asyncrpc.runtime.group.events import PeerWatchers
from asyncrpc.runtime.group.join import Group, join
from asyncrpc.runtime.group.shutdown import BarrierNews, GracefulShutdown, shutdown_limit
from asyncrpc.runtime.intraop import keep_team
from asyncrpc.runtime.lanes.client import CallerLanes
from asyncrpc.runtime.lanes.feature import Lanes
from asyncrpc.runtime.lanes.handshake import LaneRoster
from asyncrpc.runtime.lanes.probe import ProcessProbe
from asyncrpc.runtime.lanes.server import LaneServer
from asyncrpc.runtime.lanes.serving import Serving
from asyncrpc.runtime.metrics import Counters, LagProbe
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.network import Network
from asyncrpc.runtime.net.peers import Dial
from asyncrpc.runtime.net.tls import configured_tls
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.ports import ForkLedger, Frames, Loop, Ports
from asyncrpc.runtime.threads import handoffs
from asyncrpc.runtime.threads.pool import WorkerPool

_log = logging.getLogger(__name__)

__all__ = ["Agent", "FeatureFactory", "ForkFactory"]

K = TypeVar("K", bound=ForkLedger)
# Builds the RRef layer's fork bookkeeping (the floor above); the agent builds it first.
ForkFactory = Callable[[Group, RpcBackendOptions, Loop, Frames], K]
# Builds the features of the floors above, once the calls exist, from the agent's ports
# and the fork bookkeeping the other factory made.
FeatureFactory = Callable[[Ports, K], Sequence[Feature]]


class Agent:
    """One worker of a joined group. Create it with ``await Agent.start(...)`` on its loop.

    Attributes:
        group: the joined group (name, rank, members, store).
        loop: the ``Loop`` port: the asyncio loop (``loop.aio``), its thread, the pool.
        network: the ``Frames`` port: connections, peers, liveness, same-host memory.
        forks: the RRef layer's fork bookkeeping.
        outbox: the ``Calls`` port: outgoing calls.
        dispatcher: received requests.
        features: streams, the floors above's features, lanes, CUDA (in this order).
    """

    def __init__(
        self, group: Group, listener: Listener, options: RpcBackendOptions,
        loop: asyncio.AbstractEventLoop, forks: ForkFactory[Any],
        features: FeatureFactory[Any], lane_server: LaneServer, dial: Dial | None = None,
    ) -> None:  # fmt: skip
        self.group, self.options = group, options
        pool = WorkerPool(options.num_worker_threads, loop, group.name, options.max_worker_threads)
        self.loop = Loop(loop, pool)
        self.counters = Counters()
        self.lag = LagProbe(loop)
        # The program's watchers of peers joining and leaving (on_peer_lost, membership(),
        # RRef.on_owner_lost, on_caller_lost).
        self.watchers = PeerWatchers()
        self.barrier_news = BarrierNews()  # shutdown barriers peers told us are open
        group.directory.on_joined = self.watchers.on_joined
        cuda = CudaFeature(options, group.same_host)
        allocate = cuda.allocator(ReceiveBuffers().segment)  # CUDA segments: pinned memory
        self.network = Network(
            group, options, loop, self.counters, receiver=self, allocate=allocate,
            listener=listener, dial=dial,
        )  # fmt: skip
        made = forks(group, options, self.loop, self.network)
        self.forks: ForkLedger = made
        # RRefs inside payloads become forks (asyncrpc/rref/forks.py); large tensors for a
        # peer on this host may go through shared memory (asyncrpc/runtime/shm/).
        shm = self.network.shm
        self.serializer = Serializer(
            persistent_dump=made.dump, persistent_load=made.load, discard=made.undelivered,
            place=shm.place if options.shared_memory else None,
        )  # fmt: skip
        self.pipeline = Pipeline(cuda.hooks())
        lanes = self._lanes(lane_server)
        self.outbox = Outbox(
            group.name, self.loop, serializer=self.serializer, pipeline=self.pipeline,
            directory=group.directory, frames=self.network, undelivered=made.undelivered,
            unlend=shm.unlend, counters=self.counters, default_timeout=options.rpc_timeout,
            lanes=lanes.callers, inherit_deadlines=options.inherit_deadlines,
        )  # fmt: skip
        producers = Producers(group.name, self.loop, self.network, made.undelivered)
        self.dispatcher = Dispatcher(
            group.name, self.loop, self.serializer, Lanes.reply_writer(self.network.write),
            self.counters, self.pipeline, made, producers, options.print_errors,
        )  # fmt: skip
        streams = StreamHub(
            group.name, self.loop, self.outbox, self.network, self.serializer, producers,
            group.addresses, self.counters, options.stream_window, options.stream_window_bytes,
        )  # fmt: skip
        ports = Ports(group, options, self.loop, self.outbox, self.network, self.counters)
        self.lanes = lanes
        if group.tls is None:
            # A silent peer's process is probed on its lane listener before it is
            # declared lost (see runtime/net/heartbeat.py); none under TLS (no lanes).
            self.network.heartbeat.probe = ProcessProbe(
                loop, (group.name, group.rank), group.addresses, group.host_id, group.key,
                options.max_frame_size, min(1.0, options.heartbeat_timeout),
            )  # fmt: skip
        self._plug((streams, *features(ports, made), lanes, cuda))
        lanes.serve(self._serving())

    def _lanes(self, server: LaneServer) -> Lanes:
        # Calling threads' own connections for rpc_sync, and the threads serving peers'
        # lanes here. Their frames never use shared memory.
        group, options, forks = self.group, self.options, self.forks
        self._lane_serializer = Serializer(
            persistent_dump=forks.dump, persistent_load=forks.load, discard=forks.undelivered
        )
        callers = CallerLanes(
            (group.name, group.rank), group.addresses, group.host_id, group.key,
            options.max_frame_size, options.handshake_timeout, self._lane_serializer,
            small=options.shm_threshold if options.shared_memory else 1 << 20,
            enabled=options.sync_lanes > 0 and group.tls is None,
            busy_poll=options.busy_poll_us / 1e6,
            # forks a lane carried before it died (any thread): their owner is asked
            in_doubt=partial(self.loop.run_on_loop, forks.query_forks),
            acked=forks.on_lane_ack,
        )  # fmt: skip
        return Lanes(callers, server, self.loop.aio, options.idle_timeout)

    def _serving(self) -> Serving:
        group, options = self.group, self.options
        return Serving(
            group.name, group.rank, group.key, options.max_frame_size, options.handshake_timeout,
            LaneRoster.of(group.addresses, self.network.is_lost), self._lane_serializer,
            self.pipeline, self.dispatcher, self.forks, self.loop.run_on_loop,
            options.print_errors, options.busy_poll_us / 1e6,
            {coded.name: coded for feature in self.features for coded in feature.coded_calls()},
        )  # fmt: skip

    def _plug(self, features: Sequence[Feature]) -> None:
        """Take ``features``: their hooks join the pipeline, their kinds the routes."""
        self.features = tuple(features)
        self._by_name = {feature.name: feature for feature in self.features}
        # Frames by kind (a reply, the hot path, is tested before the table).
        self._routes: dict[int, Callable[[Any, Frame], None]] = {
            Kind.REQUEST: self._on_request, Kind.ERROR: self._on_error,
            Kind.CANCEL: self._on_cancel, Kind.BARRIER_OPENED: self._on_barrier_opened,
        }  # fmt: skip
        for feature in self.features:
            for hook in feature.hooks():  # after the device maps: profiling, then autograd
                self.pipeline.add(hook)
            for kind in feature.kinds:
                self._routes[kind] = feature.on_frame
        self._statistics: tuple[Callable[[], Mapping[str, float]], ...] = (
            self.counters.statistics, self._gauges, self.network.statistics,
            self.loop.pool.statistics, self.lag.statistics,
            *(feature.statistics for feature in self.features), handoffs.statistics,
        )  # fmt: skip

    def feature(self, name: str) -> Feature | None:
        """The feature called ``name`` (see ``current.FeatureSlot``); None: it has none."""
        return self._by_name.get(name)

    # -- start -----------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        name: str,
        rank: int,
        world_size: int | None,
        options: RpcBackendOptions,
        forks: ForkFactory[K],
        features: FeatureFactory[K],
        register: Callable[[Agent], None] | None = None,
    ) -> Agent:
        """Listen, join the group, then build the agent from it, on the running loop.

        Until the join the listener only parks what it accepts. ``register`` runs on the
        loop right after the agent is built, before any request can be served, so the
        agent is already "current" when the first request arrives. ``forks`` builds the
        RRef layer's fork bookkeeping, ``features`` the features of the floors above.
        Cancelling the start closes whatever was opened.

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
        try:
            # Lanes are plain sockets: none under TLS (the server then listens on nothing).
            limit = options.sync_lanes if tls is None else 0
            lanes = LaneServer.listen(options.listen_host, options.unix_sockets, limit)
        except BaseException:
            listener.close()
            raise
        try:
            where = (lanes.port, lanes.path)
            group = await join(name, rank, world_size, options, listener, tls, where)
            loop = asyncio.get_running_loop()
            agent = cls(group, listener, options, loop, forks, features, lanes)
        except BaseException:
            listener.close()
            lanes.close()
            raise
        try:
            if register is not None:
                register(agent)
        except BaseException:
            await agent._close_transports(graceful=False)
            raise
        set_default_callback_loop(loop, agent.loop.thread_id)
        keep_team()  # the loop thread's OpenMP team, as before its passes ran alone
        agent.lag.start()
        agent.network.start()
        return agent

    # -- addressing (the group's directory) ------------------------------------------------

    def worker_infos(self) -> list[WorkerInfo]:
        """The group's members by rank. Dynamic group: read in the store (blocking) when
        called off the loop thread, else the members this worker knows."""
        return self.group.directory.worker_infos(not self.loop.on_loop_thread())

    # -- receiving (asyncrpc.runtime.net.network.Receiver) ---------------------------------

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """Route an authenticated frame by its kind: replies, requests, cancels, and the
        kinds the features own (RRef bookkeeping, streams)."""
        fields = frame.fields
        kind = fields[0] if fields else None
        if kind == Kind.REPLY:  # the hot path first
            self.outbox.on_reply(fields, frame)
            return
        route = self._routes.get(kind) if type(kind) is int else None
        try:
            if route is None:
                message = decode_message(fields)
                raise RemoteProtocolError(f"unexpected {type(message).__name__} after handshake")
            route(conn, frame)
        except RemoteProtocolError as exc:  # the peer sent garbage: its connection goes
            self.counters.protocol_errors += 1
            conn.abort(exc)

    def _on_request(self, conn: Connection, frame: Frame) -> None:
        request = decode_message(frame.fields)
        assert isinstance(request, Request)  # decoded by its kind
        self.counters.calls_received += 1
        self.dispatcher.on_request(conn, request, frame.payload, frame.segments, frame.nbytes)

    def _on_error(self, conn: Connection, frame: Frame) -> None:
        decode_message(frame.fields)  # checked, then read by the outbox
        self.outbox.on_error(frame.fields, frame)

    def _on_cancel(self, conn: Connection, frame: Frame) -> None:
        cancel = decode_message(frame.fields)
        assert isinstance(cancel, Cancel)
        assert conn.peer is not None
        self.dispatcher.on_cancel(conn.peer, cancel.call_id)

    def _on_barrier_opened(self, conn: Connection, frame: Frame) -> None:
        message = decode_message(frame.fields)
        assert isinstance(message, BarrierOpened)
        self.barrier_news.heard(message, self.group.world_size)

    def on_connection_lost(self, rank: int, conn: Connection, error: PeerLostError) -> None:
        """Calls written on ``conn`` may or may not have run: they fail, typed; calls still
        waiting for a connection are sent on the next one."""
        self.outbox.fail_peer(rank, error, sent_on=conn)
        # Calls that came on it are cancelled (nobody reads their replies); remote()
        # requests run on: their value must still land here.
        self.dispatcher.cancel_connection(conn)
        for feature in self.features:
            feature.on_connection_lost(rank, conn, error)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good: fail everything bound for it, forget its RRefs, and
        tell the program's watchers (a peer that left by shutting down is no loss)."""
        self.outbox.fail_peer(rank, error)
        self.dispatcher.cancel_peer(rank)
        for feature in self.features:
            feature.on_peer_lost(rank, error)
        self.watchers.on_gone(rank, error, left=error.evidence == "goodbye")

    def busy_peers(self) -> set[int]:
        """The ranks with a call of ours waiting for its reply, or a request of theirs
        running here (streams are calls on the consumer's side)."""
        return set(self.outbox.pending.count_by_peer()) | self.dispatcher.running_peers()

    def on_forks_unsent(self, rank: int, forks: list[ForkPair]) -> None:
        self.forks.undelivered(rank, forks)

    def on_forks_in_doubt(self, rank: int, forks: list[ForkPair]) -> None:
        self.forks.query_forks(rank, forks)

    def on_unknown_peer(self, rank: int) -> None:
        self.forks.on_peer_lost(rank)  # forks it owns wait for no confirmation

    # -- stopping --------------------------------------------------------------------------

    def calls_in_flight(self) -> int:
        return len(self.outbox) + self.lanes.in_flight

    def requests_running(self) -> int:
        return len(self.dispatcher) + self.lanes.running

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
        rounds = GracefulShutdown(
            self.group, rrefs=self.forks, liveness=self.network,
            calls_in_flight=self.calls_in_flight, requests_running=self.requests_running,
            news=self.barrier_news,
        )  # fmt: skip
        # This worker reads no more (its streams' consumers end now), and what features
        # hold back leaves now, so the rounds wait for it like any outstanding call.
        for feature in self.features:
            feature.flush()
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
        for feature in self.features:  # streams first: their calls end as streams do
            feature.close()
        self.outbox.close()
        self.watchers.close()  # membership() iterations end
        await asyncio.sleep(0)  # let the transports flush and call connection_lost
        self.loop.pool.shutdown()
        await self.loop.pool.stopped(timeout=1.0)
        set_default_callback_loop(None, None)

    # -- introspection ---------------------------------------------------------------------

    def _gauges(self) -> dict[str, int]:
        return {"pending_calls": len(self.outbox), "running_requests": len(self.dispatcher)}

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges of this worker (see ``asyncrpc.get_metrics``): every part's
        and feature's statistics; a figure several report (calls on lanes and on the loop)
        is their sum."""
        figures: dict[str, Any] = {}
        for statistics in self._statistics:
            for key, value in statistics().items():
                figures[key] = figures.get(key, 0) + value
        return figures

    def debug_info(self) -> dict[str, Any]:
        """Metrics plus identity, peers and RRef bookkeeping (see ``asyncrpc.get_debug_info``)."""
        group, pending = self.group, self.outbox.pending
        return {
            "name": group.name,
            "rank": group.rank,
            "world_size": group.world_size,
            "rpc_timeout": self.options.rpc_timeout,
            "pending_by_peer": {
                group.addresses[r].name: n for r, n in pending.count_by_peer().items()
            },
            "lost_peers": self.network.lost_peers(),
            "leaving": self.network.leaving,  # its shutdown has begun
            **self.metrics(),
            "unacked_ref_frames": self.network.links.unacked_frames(),
            **{k: v for feature in self.features for k, v in feature.debug_info().items()},
            **{k: v for hook in self.pipeline.hooks for k, v in hook.debug_info().items()},
        }
