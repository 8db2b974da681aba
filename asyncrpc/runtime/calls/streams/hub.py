"""Streaming calls of one agent, a feature: opens streams, routes stream frames, ends them
with the agent's lifecycle (layer L2.42, on the agent's loop unless said otherwise).

A stream is a call in ``CallMode.STREAM``: the request is pickled, framed and passed
through the call pipeline like any call (``Outbox.encode``), and its ``PendingCall`` (with
the whole stream's limit, if any) stands for the whole stream, so what ends a call ends a
stream the same way: the producer's last frame, an error reply, a lost connection or
peer, a shutdown; and the pipeline's hooks see one call per stream (profiling: one span,
the item count as its value). The items themselves go around the pending table, straight to the
``ConsumerStream`` (``consumer.py``); the producing side is ``producer.py``.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable, Sequence
from typing import Any

from asyncrpc.errors import ClosedError, PeerLostError, RemoteProtocolError, SerializationError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy, TrackGrads
from asyncrpc.protocol.wire import Frame, encode_frame
from asyncrpc.protocol.wire.messages import CallMode
from asyncrpc.protocol.wire.stream import (
    ITEM_KIND,
    STREAM_KINDS,
    VALUE_KIND,
    StreamClose,
    StreamCredit,
    StreamEnd,
    decode_item,
    decode_stream_message,
)
from asyncrpc.runtime.calls.outbox import EncodedRequest, Outbox
from asyncrpc.runtime.calls.pipeline import CallKind, Pipeline
from asyncrpc.runtime.calls.streams.closing import close_iterable
from asyncrpc.runtime.calls.streams.consumer import Arrived, ConsumerStream
from asyncrpc.runtime.calls.streams.producer import Producers
from asyncrpc.runtime.calls.streams.sources import Sources
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Frames, Loop, OutgoingFrame

__all__ = ["StreamHub"]

_log = logging.getLogger(__name__)
_UNCLAIMED_S = 300.0  # how long a stream argument waits for its request to arrive
_ITEMS = frozenset({ITEM_KIND, VALUE_KIND})


class StreamHub(Feature):
    """The streams of one agent, both ways.

    Args:
        name: this worker's name.
        loop: the agent's loop (consumers live on it).
        outbox: encodes and starts the stream requests; their pending calls end streams.
        frames: writes credit and close frames.
        serializer: unpickles items.
        producers: the streams this worker produces (the dispatcher starts them).
        addresses: the members' names, by rank.
        counters: the worker's counters (protocol errors, failed calls).
        window: the default number of items a producer may run ahead.
        window_bytes: the default number of bytes a producer may run ahead (0: not
            counted).
    """

    name = "streams"
    kinds = STREAM_KINDS

    def __init__(
        self, name: str, loop: Loop, outbox: Outbox, frames: Frames, serializer: Serializer,
        producers: Producers, addresses: dict[int, PeerAddress], counters: Counters,
        window: int, window_bytes: int = 0,
    ) -> None:  # fmt: skip
        self._name, self._loop, self._outbox, self._frames = name, loop, outbox, frames
        self._serializer, self._addresses, self._counters = serializer, addresses, counters
        self._window, self._window_bytes = window, window_bytes
        self.producers = producers
        self._consumers: dict[int, ConsumerStream] = {}
        # Tasks sending what ended streams still owe their producers (``_settle``).
        self._settling: set[asyncio.Task[None]] = set()
        self.items_received = 0
        # Iterables sent as stream arguments, until their callee opens them; one whose
        # request never arrived is closed after as long as a call may last, or 5 minutes
        # without a default timeout (see sources.py).
        expiry = outbox.effective_timeout(UNSET_RPC_TIMEOUT) or _UNCLAIMED_S
        self.sources = Sources(
            lambda items: close_iterable(loop, items), expiry,
            lambda delay, sweep: loop.aio.call_soon_threadsafe(loop.aio.call_later, delay, sweep),
        )  # fmt: skip

    @property
    def worker_name(self) -> str:
        return self._name

    @property
    def loop(self) -> Loop:
        return self._loop

    @property
    def default_window(self) -> int:
        return self._window

    # -- opening (any thread) ----------------------------------------------------------------

    def open(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        window: int | None, target: str | None = None, total_timeout: float = 0.0,
        window_bytes: int | None = None, serving: bool = False,
    ) -> Stream[Any]:  # fmt: skip
        """Start ``fn(*args, **kwargs)`` on ``to`` as a stream and return its ``Stream``;
        ``timeout`` bounds each wait for an item, ``total_timeout`` the whole stream (0:
        none; inside a served request, no later than its deadline): both ends stop then.
        The producer runs at most ``window`` items and about ``window_bytes`` bytes ahead
        (None: the options' defaults; 0 bytes: items only). ``serving``: a stream argument
        of a request this worker serves (a graceful shutdown lets it run, see ``flush``).

        Raises:
            ValueError: ``window`` is not a positive int, ``window_bytes`` not an int >= 0,
                or the timeout is NaN.
            UnknownWorkerError, SerializationError, ClosedError: at once, as for calls.
        """
        loop, outbox = self._loop, self._outbox
        window = self._window if window is None else window
        if type(window) is not int or window < 1:
            raise ValueError(f"a stream window must be a positive int, got {window!r}")
        window_bytes = self._window_bytes if window_bytes is None else window_bytes
        if type(window_bytes) is not int or window_bytes < 0:
            raise ValueError(f"a stream's window_bytes must be an int >= 0, got {window_bytes!r}")
        rank = outbox.resolve(to)
        item_timeout = outbox.effective_timeout(timeout)
        # The whole stream's limit rides as the request's timeout: the pending call fails
        # with RpcTimeoutError then, and the producer closes its generator.
        total = outbox.stream_limit(total_timeout)
        encoded = outbox.encode(
            rank, fn, args, kwargs, total, CallKind.STREAM, CallMode.STREAM, target=target
        )
        stream_id, target = encoded.call_id, encoded.target
        name = self._addresses[rank].name
        consumer = ConsumerStream(
            loop.aio, stream_id, rank, name, target, item_timeout, window, self, window_bytes
        )
        consumer.serving = serving
        # The hooks' policy of its items (CUDA: copied in on side streams, each reader
        # ordered after its item's copies); None: the defaults.
        consumer.items_in = self._outbox.pipeline.items_in(rank)
        # The stream's outcome; the waiter is an asyncio future: only the loop touches it.
        ended: asyncio.Future[Any] = loop.aio.create_future()
        ended.add_done_callback(lambda done: self._ended(consumer, done))
        loop.run_on_loop(self._begin, consumer, encoded, ended)
        return Stream(consumer, loop.aio, loop.thread_id, loop.run_on_loop)

    def _begin(
        self, consumer: ConsumerStream, encoded: EncodedRequest, ended: asyncio.Future[Any]
    ) -> None:
        stream_id = consumer.stream_id
        self._consumers[stream_id] = consumer
        consumer.links = links = self._outbox.pipeline.stream_links(consumer.peer)
        self._outbox.start(encoded, ended)
        if stream_id in self._outbox.pending:  # written (or waiting to be): first credit
            headers = None if links is None else links.fields()
            credit = StreamCredit(stream_id, *consumer.flow.initial(), headers)
            pieces = encode_frame(credit.to_fields(), b"")
            self._frames.send(OutgoingFrame(consumer.peer, pieces))

    def _ended(self, consumer: ConsumerStream, done: asyncio.Future[Any]) -> None:
        self._consumers.pop(consumer.stream_id, None)
        consumer.finished(None if done.cancelled() else done.exception())
        links = consumer.links
        owed = None if links is None else links.owed()
        if owed is not None:  # the producer's last blocks, named back once copied out
            task = self._loop.aio.create_task(self._settle(consumer, owed))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _settle(self, consumer: ConsumerStream, owed: Awaitable[None]) -> None:
        """A stream is over with what its hooks still owe its producer (CUDA blocks being
        copied out): once that is ready, one close frame, harmless to an ended stream,
        carries it."""
        await owed
        links = consumer.links
        headers = None if links is None else links.fields()
        if headers:
            self._control(consumer.peer, StreamClose(consumer.stream_id, headers).to_fields())

    def notify(self, to: Any, fn: Any, args: tuple[Any, ...]) -> None:
        """Call ``fn(*args)`` on ``to`` and forget it: the stream arguments' bookkeeping
        between workers (claims, releases). Any thread; a failure is only logged."""
        try:
            self._outbox.call_future(to, fn, args, {}, UNSET_RPC_TIMEOUT)
        except Exception as exc:  # shut down, or the peer is gone: its entry goes anyway
            _log.debug("could not tell %r about a stream argument: %r", to, exc)

    # -- the consumers' requests (ConsumerHub) -----------------------------------------------

    def grant(self, stream: ConsumerStream, count: int, nbytes: int) -> None:
        if not stream.ended:
            headers = None if stream.links is None else stream.links.fields()
            credit = StreamCredit(stream.stream_id, count, nbytes, headers)
            self._control(stream.peer, credit.to_fields())

    def close_stream(self, stream: ConsumerStream, error: BaseException | None = None) -> None:
        """Close a stream this worker consumes; ``error`` goes to a fetch waiting on it."""
        if stream.closed:
            return
        self._consumers.pop(stream.stream_id, None)
        call = self._outbox.pending.pop(stream.stream_id)
        stream.shut(error)
        if call is not None:  # the producer may still run: stop it
            headers = None if stream.links is None else stream.links.fields()
            call.fail(asyncio.CancelledError())
            self._control(stream.peer, StreamClose(stream.stream_id, headers).to_fields())

    def _control(self, rank: int, fields: list[Any]) -> None:
        self._frames.control(rank, encode_frame(fields, b""))  # if connected, else dropped

    # -- frames ------------------------------------------------------------------------------

    def on_frame(self, conn: Any, frame: Frame) -> None:
        """A stream frame arrived on an authenticated connection.

        Raises:
            RemoteProtocolError: the frame is malformed (the agent aborts the connection).
        """
        fields = frame.fields
        kind = fields[0] if fields else None
        if kind in _ITEMS:  # most frames: no message object made
            self._on_item(conn.peer, decode_item(fields), frame, kind == VALUE_KIND)
            return
        message = decode_stream_message(fields)
        peer = conn.peer
        if message.headers:  # the hooks' fields first, whether its stream is open or not
            self._outbox.pipeline.stream_received(peer, message.headers)
        if isinstance(message, StreamCredit):
            self.producers.on_credit(peer, message.stream_id, message.count, message.nbytes)
        elif isinstance(message, StreamClose):
            self.producers.on_close(peer, message.stream_id)
        else:
            self._on_outcome(peer, message, frame)

    def _on_item(
        self, peer: int, item: tuple[int, int, int, dict[str, Any] | None], frame: Frame,
        plain: bool = False,
    ) -> None:  # fmt: skip
        stream_id, seq, nbytes, headers = item
        if headers:  # the hooks' per-peer fields first: they count for every stream
            self._outbox.pipeline.stream_received(peer, headers)
        stream = self._consumers.get(stream_id)
        if stream is None or stream.peer != peer:
            self._unread(peer, frame)  # closed meanwhile: the producer stops at our close
            return
        try:
            stream.flow.check(seq, nbytes)
            if plain and not headers:  # a scalar: pickle's own loads, nothing to track
                value = _plain(frame)
            else:
                value = self._value(stream, peer, headers, frame)
        except Exception as exc:  # RemoteProtocolError: the flow refused it (counted)
            if isinstance(exc, RemoteProtocolError):
                self._counters.protocol_errors += 1
            self.close_stream(stream, exc)
            return
        self.items_received += 1
        stream.on_item(seq, value)

    def _value(
        self, stream: ConsumerStream, peer: int, headers: dict[str, Any] | None, frame: Frame
    ) -> Any:
        """An item unpickled under the hooks' policy (``Arrived`` when its reader must call
        something first), its fields given to the stream's call's hooks.

        Raises:
            SerializationError: it cannot be unpickled, or a hook refused it.
        """
        observed, items_in = None, stream.items_in
        policy: TensorPolicy | None = items_in
        grads: TrackGrads | None = None
        if headers:  # the hooks' fields: the stream's call, its hooks, its items' grads
            call = self._outbox.pending.get(stream.stream_id)
            observed = None if call is None else call.request.observed
            if observed is not None:
                policy = grads = TrackGrads(items_in or DEFAULT)
        value = self._serializer.loads(frame.payload, frame.segments, context=peer, policy=policy)
        if observed is not None and headers and grads is not None:
            Pipeline.item_received(*observed, headers, grads.take())
        if items_in is not None:
            first = items_in.take()
            if first is not None:  # its reader's streams wait for its copies first
                value = Arrived(value, first)
        return value

    def _unread(self, peer: int, frame: Frame) -> None:
        """An item for a stream no longer read here: what it holds for this worker (CUDA
        blocks) is let go unread."""
        if frame.tags:
            links = self._outbox.pipeline.stream_links(peer)
            if links is not None:
                links.dropped(frame.tags)

    def _on_outcome(self, peer: int, message: Any, frame: Frame) -> None:
        stream = self._consumers.get(message.stream_id)
        if stream is None or stream.peer != peer:
            return
        call = self._outbox.pending.pop(message.stream_id)
        if call is None:
            return
        headers = message.headers or None  # the hooks' stream fields taken out already
        if not isinstance(message, StreamEnd):
            self._counters.calls_failed += 1
            call.fail(unpack_exception(bytes(frame.payload)), headers)
            return
        try:
            stream.flow.check_end(message.count)
        except RemoteProtocolError as exc:
            self._counters.protocol_errors += 1
            call.fail(exc)
            return
        call.resolve(message.count, headers)

    # -- lifecycle ---------------------------------------------------------------------------

    def on_connection_lost(self, rank: int, conn: Any, error: PeerLostError) -> None:
        """Streams consumed over ``conn`` fail with their pending call; those produced for it
        stop (nobody reads them)."""
        self.producers.close_connection(conn)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        self.producers.close_peer(rank)
        self.sources.drop_peer(rank)  # stream arguments it received and will never read

    def flush(self) -> None:
        """This worker begins to shut down: it reads no more. Its consumers get
        ``ClosedError`` and their producers are told and stopped. The streams it produces
        are not outstanding work (an endless one would hold the barrier) but go on while
        the barrier waits: a worker that calls shutdown() right after joining, torch's way
        of serving until everybody is done, still serves streams. They end when their
        consumers close them (a consumer's own shutdown does) or when this worker stops
        (``close``). So do the stream arguments of the requests it serves: reading them is
        serving the request, as producing a stream is."""
        for stream in list(self._consumers.values()):
            if not stream.serving:
                self.close_stream(stream, ClosedError(f"worker {self._name!r} shut down"))

    def close(self) -> None:
        """This worker stops: its consumers are closed (``flush``, then those serving
        requests), and every producer's consumer is told."""
        self.flush()
        for stream in list(self._consumers.values()):
            self.close_stream(stream, ClosedError(f"worker {self._name!r} shut down"))
        self.sources.close_all()
        for task in list(self._settling):  # nobody is left to tell
            task.cancel()
        if len(self.producers):
            self.producers.close_all(PeerLostError(self._name, "it shut down while streaming"))

    def statistics(self) -> dict[str, int | float]:
        return {
            "streams_consuming": len(self._consumers),
            "streams_producing": len(self.producers),
            "stream_items_sent": self.producers.items_sent,
            "stream_items_received": self.items_received,
            "stream_args_held": len(self.sources),
            "stream_args_unclaimed": self.sources.unclaimed,
        }


def _plain(frame: Frame) -> Any:
    """The value of a ``STREAM_VALUE`` item: a plain pickle of a scalar.

    Raises:
        SerializationError: it is not one (no segment may come with it, and pickle's own
            loads reads it).
    """
    if frame.segments:
        raise SerializationError("a plain stream item came with tensor segments")
    try:
        return pickle.loads(frame.payload)
    except Exception as exc:
        raise SerializationError(
            f"cannot unpickle a plain stream item: {type(exc).__name__}: {exc}"
        ) from exc
