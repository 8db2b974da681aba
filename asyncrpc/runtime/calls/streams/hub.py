"""Streaming calls of one agent: opens streams, routes stream frames, ends them with the
agent's lifecycle (layer L2, on the agent's loop unless said otherwise).

A stream is a call in ``CallMode.STREAM``: the request is pickled, framed and passed
through the call pipeline like any call (``Outbox.encode``), and its ``PendingCall`` (no
deadline) stands for the whole stream, so what ends a call ends a stream the same way: the
producer's last frame, an error reply, a lost connection or peer, a shutdown; and the
pipeline's hooks see one call per stream (profiling: one span, the item count as its
value). The items themselves go around the pending table, straight to the
``ConsumerStream`` (``consumer.py``); the producing side is ``producer.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asyncrpc.errors import ClosedError, PeerLostError, RemoteProtocolError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.wire import Frame, encode_frame
from asyncrpc.protocol.wire.messages import CallMode
from asyncrpc.protocol.wire.stream import (
    StreamClose,
    StreamCredit,
    StreamEnd,
    StreamItem,
    decode_stream_message,
)
from asyncrpc.runtime.calls.outbox import EncodedRequest, Outbox
from asyncrpc.runtime.calls.pending import PendingCalls
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.calls.streams.consumer import ConsumerStream
from asyncrpc.runtime.calls.streams.producer import ProducerHost, Producers
from asyncrpc.runtime.calls.streams.stream import Stream
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.net.network import Network

__all__ = ["StreamHost", "Streams"]


class StreamHost(ProducerHost, Protocol):
    """What the streams use of their agent."""

    rank: int
    loop_thread_id: int
    options: RpcBackendOptions
    counters: Counters
    pending: PendingCalls
    addresses: dict[int, PeerAddress]
    serializer: Serializer
    outbox: Outbox
    network: Network

    def resolve(self, to: Any) -> int: ...

    def effective_timeout(self, timeout: float) -> float: ...

    def run_on_loop(self, fn: Callable[..., Any], *args: Any) -> None: ...


class Streams:
    """The streams of one agent, both ways."""

    def __init__(self, host: StreamHost, send_control: Callable[[int, list[Any]], None]) -> None:
        self._host = host
        self._send_control = send_control  # writes a frame if connected, else drops it
        self.producers = Producers(host)
        self._consumers: dict[int, ConsumerStream] = {}
        self.items_received = 0

    # -- opening (any thread) ----------------------------------------------------------------

    def open(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        window: int | None, target: str | None = None,
    ) -> Stream[Any]:  # fmt: skip
        """Start ``fn(*args, **kwargs)`` on ``to`` as a stream and return its ``Stream``.

        Raises:
            ValueError: ``window`` is not a positive number of items, or the timeout is NaN.
            UnknownWorkerError, SerializationError, ClosedError: at once, as for calls.
        """
        host = self._host
        window = host.options.stream_window if window is None else window
        if type(window) is not int or window < 1:
            raise ValueError(f"a stream window must be a positive int, got {window!r}")
        rank = host.resolve(to)
        item_timeout = host.effective_timeout(timeout)
        encoded = host.outbox.encode(
            rank, fn, args, kwargs, 0.0, CallKind.STREAM, CallMode.STREAM, target=target
        )
        stream_id, target = encoded.call_id, encoded.target
        name = host.addresses[rank].name
        consumer = ConsumerStream(
            host.loop, stream_id, rank, name, target, item_timeout, window, self
        )
        # The stream's outcome; the waiter is an asyncio future: only the loop touches it.
        ended: asyncio.Future[Any] = host.loop.create_future()
        ended.add_done_callback(lambda done: self._ended(consumer, done))
        host.run_on_loop(self._begin, consumer, encoded, ended)
        return Stream(consumer, host.loop, host.loop_thread_id, host.run_on_loop)

    def _begin(
        self, consumer: ConsumerStream, encoded: EncodedRequest, ended: asyncio.Future[Any]
    ) -> None:
        host, stream_id = self._host, consumer.stream_id
        self._consumers[stream_id] = consumer
        host.outbox.start(encoded, ended)
        if stream_id in host.pending:  # written (or waiting for the connection): first credit
            credit = StreamCredit(stream_id, consumer.flow.initial())
            host.network.send_to(consumer.peer, encode_frame(credit.to_fields(), b""))

    def _ended(self, consumer: ConsumerStream, done: asyncio.Future[Any]) -> None:
        self._consumers.pop(consumer.stream_id, None)
        consumer.finished(None if done.cancelled() else done.exception())

    # -- the consumers' requests (ConsumerHub) -----------------------------------------------

    def grant(self, stream: ConsumerStream, count: int) -> None:
        if not stream.ended:
            self._control(stream.peer, StreamCredit(stream.stream_id, count).to_fields())

    def close(self, stream: ConsumerStream, error: BaseException | None = None) -> None:
        """Close a stream this worker consumes; ``error`` goes to a fetch waiting on it."""
        if stream.closed:
            return
        self._consumers.pop(stream.stream_id, None)
        call = self._host.pending.pop(stream.stream_id)
        stream.shut(error)
        if call is not None:  # the producer may still run: stop it
            call.fail(asyncio.CancelledError())
            self._control(stream.peer, StreamClose(stream.stream_id).to_fields())

    def _control(self, rank: int, fields: list[Any]) -> None:
        pieces = encode_frame(fields, b"")
        if rank == self._host.rank:
            self._host.network.loopback.send(pieces)
        else:
            self._send_control(rank, pieces)

    # -- frames ------------------------------------------------------------------------------

    def on_frame(self, conn: Any, frame: Frame) -> None:
        """A stream frame arrived on an authenticated connection."""
        try:
            message = decode_stream_message(frame.fields)
        except RemoteProtocolError as exc:
            self._host.counters.protocol_errors += 1
            conn.abort(exc)
            return
        peer = conn.peer
        if isinstance(message, StreamItem):
            self._on_item(peer, message, frame)
        elif isinstance(message, StreamCredit):
            self.producers.on_credit(peer, message.stream_id, message.count)
        elif isinstance(message, StreamClose):
            self.producers.on_close(peer, message.stream_id)
        else:
            self._on_outcome(peer, message, frame)

    def _on_item(self, peer: int, message: StreamItem, frame: Frame) -> None:
        stream = self._consumers.get(message.stream_id)
        if stream is None or stream.peer != peer:
            return  # closed meanwhile: the producer stops at our close
        try:
            stream.flow.check(message.seq)
        except RemoteProtocolError as exc:
            self._host.counters.protocol_errors += 1
            self.close(stream, exc)
            return
        try:
            value = self._host.serializer.loads(frame.payload, frame.segments, context=peer)
        except Exception as exc:
            self.close(stream, exc)
            return
        self.items_received += 1
        stream.on_item(message.seq, value)

    def _on_outcome(self, peer: int, message: Any, frame: Frame) -> None:
        stream = self._consumers.get(message.stream_id)
        if stream is None or stream.peer != peer:
            return
        call = self._host.pending.pop(message.stream_id)
        if call is None:
            return
        if not isinstance(message, StreamEnd):
            self._host.counters.calls_failed += 1
            call.fail(unpack_exception(bytes(frame.payload)), message.headers)
            return
        try:
            stream.flow.check_end(message.count)
        except RemoteProtocolError as exc:
            self._host.counters.protocol_errors += 1
            call.fail(exc)
            return
        call.resolve(message.count, message.headers)

    # -- lifecycle ---------------------------------------------------------------------------

    def on_connection_lost(self, conn: Any) -> None:
        """Streams consumed over ``conn`` fail with their pending call; those produced for it
        stop (nobody reads them)."""
        self.producers.close_connection(conn)

    def on_peer_lost(self, rank: int) -> None:
        self.producers.close_peer(rank)

    def close_consumers(self) -> None:
        """This worker begins to shut down: it reads no more. Its consumers get
        ``ClosedError`` and their producers are told and stopped; the streams it produces
        go on (see ``close_all``)."""
        host = self._host
        for stream in list(self._consumers.values()):
            self.close(stream, ClosedError(f"worker {host.name!r} shut down"))

    def close_all(self) -> None:
        """This worker stops: ``close_consumers``, and every producer's consumer is told."""
        host = self._host
        self.close_consumers()
        if len(self.producers):
            self.producers.close_all(PeerLostError(host.name, "it shut down while streaming"))

    def stats(self) -> dict[str, int]:
        return {
            "streams_consuming": len(self._consumers),
            "streams_producing": len(self.producers),
            "stream_items_sent": self.producers.items_sent,
            "stream_items_received": self.items_received,
        }
