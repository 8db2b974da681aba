"""Stream frames: the items of a streaming call and their flow control (layer L1, sans-I/O).

A stream starts as a ``Request`` in ``CallMode.STREAM`` whose call id names the stream; the
caller then grants the producer its first credit. From then on, only these five frames
carry it, each naming its stream by that id:

  producer -> consumer: ``StreamItem`` (one item: payload and tensor segments, numbered
      from 0, with their size in bytes; of kind ``STREAM_VALUE`` rather than
      ``STREAM_ITEM`` when its payload is a plain pickle of a scalar, which the consumer
      reads with pickle's own ``loads``, no tensor or reference hook needed), then exactly
      one of ``StreamEnd`` (the generator
      finished after ``count`` items) or ``StreamError`` (it raised after ``count`` items;
      the payload is the packed exception);
  consumer -> producer: ``StreamCredit`` (``count`` more items and ``nbytes`` more bytes
      may be sent) and ``StreamClose`` (stop: the consumer is gone).

Every one of them may carry the call pipeline's header fields for the frames between the
two workers (the CUDA IPC blocks a consumer gives back ride on its credit and close
frames, see ``runtime/calls/pipeline.py``'s ``stream_links``). A ``StreamClose`` for a
stream the producer no longer has is harmless: it only carries such fields.

Credit is counted in items and in bytes, as gRPC counts bytes: a window of 128 items is
harmless for small items and 8 GiB for 64 MiB tensors. The credit rules (``ProducerFlow``,
``ConsumerFlow``) are pure state machines too, so both sides' bookkeeping is unit-tested
without a loop. Like every frame after ``Hello``, these
are refused before the handshake completes (the pre-auth decoder admits handshake kinds
only, and the agent routes them only on an authenticated connection).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from asyncrpc.errors import LocalProtocolError, RemoteProtocolError
from asyncrpc.protocol.wire.frame import MAGIC, PRELUDE, PROTOCOL_VERSION, U32_LIMIT
from asyncrpc.protocol.wire.messages import Kind, optional_headers

__all__ = [
    "ITEM_KIND",
    "STREAM_KINDS",
    "VALUE_KIND",
    "ConsumerFlow",
    "ProducerFlow",
    "StreamClose",
    "StreamCredit",
    "StreamEnd",
    "StreamError",
    "StreamItem",
    "StreamMessage",
    "decode_item",
    "decode_stream_message",
    "encode_item",
    "item_fields",
]

ITEM_KIND = int(Kind.STREAM_ITEM)  # plain ints: compared once per received frame
VALUE_KIND = int(Kind.STREAM_VALUE)


@dataclass(frozen=True, slots=True)
class StreamItem:
    """Item number ``seq`` (from 0) of stream ``stream_id``; the payload is its pickle,
    with the call pipeline's fields for it, if any (as a reply has them).

    ``nbytes`` is what the item costs in byte credit: its payload and tensor segments as
    written (the header aside). The producer states it because it is the side that knows
    it before the bytes leave, and both sides must count the same number.
    """

    stream_id: int
    seq: int
    nbytes: int = 0
    # The pipeline's fields for this item, if any (distributed autograd's message ids).
    headers: dict[str, Any] | None = None
    plain: bool = False  # a plain pickle of a scalar (kind STREAM_VALUE)

    def to_fields(self) -> list[Any]:
        return item_fields(self.stream_id, self.seq, self.nbytes, self.headers, self.plain)


def item_fields(
    stream_id: int, seq: int, nbytes: int, headers: dict[str, Any] | None = None,
    plain: bool = False,
) -> list[Any]:  # fmt: skip
    """The header array of a ``StreamItem``, without making one: the producer's path for
    every item (a frozen dataclass costs more to build than the frame it describes)."""
    fields: list[Any] = [VALUE_KIND if plain else ITEM_KIND, stream_id, seq, nbytes]
    if headers:
        fields.append(headers)
    return fields


def encode_item(
    packer: msgpack.Packer, fields: list[Any], payload: bytes
) -> tuple[list[bytes], int]:
    """The frame of an item with no tensor segments, as ``encode_frame`` makes it, packed
    with the caller's ``packer`` (one per stream: its items are framed on one thread at a
    time, and a packer made per frame costs as much as the rest); its pieces and size.
    ``fields`` (``item_fields``'s list) gets the empty segment list appended.

    Raises:
        LocalProtocolError: a header field cannot be packed, or the payload is 4 GiB or
            larger.
    """
    try:
        fields.append(_NO_SEGMENTS)
        header = packer.pack(fields)
    except (TypeError, ValueError, OverflowError) as exc:
        packer.reset()  # a failed pack may leave bytes behind
        raise LocalProtocolError(f"cannot pack the frame header: {exc}") from exc
    size = len(payload)
    if size >= U32_LIMIT:
        raise LocalProtocolError(f"an item's payload of {size} bytes is over 4 GiB")
    head = PRELUDE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, len(header), size, 0) + header
    return ([head, payload] if size else [head]), len(head) + size


_NO_SEGMENTS: list[Any] = []  # packed, never changed


def decode_item(fields: list[Any]) -> tuple[int, int, int, dict[str, Any] | None]:
    """The stream id, number, size and header fields of a ``StreamItem`` header array,
    checked as ``decode_stream_message`` checks them, without making the message: the
    consumer's path for every item.

    Raises:
        RemoteProtocolError: the array is not a valid item header.
    """
    try:
        stream_id, seq, nbytes = fields[1], fields[2], fields[3]
        # bool is an int subclass, and a peer sending True for a count is broken.
        if not (type(stream_id) is type(seq) is type(nbytes) is int):
            raise TypeError("expected ints")
        if stream_id < 0 or seq < 0 or nbytes < 0:
            raise ValueError("expected non-negative ints")
        return stream_id, seq, nbytes, optional_headers(fields, 4)
    except (IndexError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed stream header: {fields!r:.200}") from exc


@dataclass(frozen=True, slots=True)
class StreamCredit:
    """The producer of ``stream_id`` may send ``count`` more items and ``nbytes`` more bytes.

    The first credit of a stream is its windows; each later one returns what the consumer
    consumed. A first credit of 0 bytes means the stream counts items only.
    """

    stream_id: int
    count: int
    nbytes: int = 0
    headers: dict[str, Any] | None = None  # the pipeline's fields for frames to the producer

    def to_fields(self) -> list[Any]:
        fields: list[Any] = [Kind.STREAM_CREDIT, self.stream_id, self.count]
        if self.nbytes or self.headers:
            fields.append(self.nbytes)
        if self.headers:
            fields.append(self.headers)
        return fields


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The producer of ``stream_id`` finished after ``count`` items, with the pipeline's
    reply fields if any."""

    stream_id: int
    count: int
    headers: dict[str, Any] | None = None

    def to_fields(self) -> list[Any]:
        fields: list[Any] = [Kind.STREAM_END, self.stream_id, self.count]
        if self.headers:
            fields.append(self.headers)
        return fields


@dataclass(frozen=True, slots=True)
class StreamError:
    """The producer of ``stream_id`` raised after ``count`` items; the payload is the packed
    exception."""

    stream_id: int
    count: int
    headers: dict[str, Any] | None = None

    def to_fields(self) -> list[Any]:
        fields: list[Any] = [Kind.STREAM_ERROR, self.stream_id, self.count]
        if self.headers:
            fields.append(self.headers)
        return fields


@dataclass(frozen=True, slots=True)
class StreamClose:
    """The consumer of ``stream_id`` is gone: stop the producer and send nothing more
    (nothing to stop once the stream ended: then it only carries ``headers``)."""

    stream_id: int
    headers: dict[str, Any] | None = None  # the pipeline's fields for frames to the producer

    def to_fields(self) -> list[Any]:
        if self.headers:
            return [Kind.STREAM_CLOSE, self.stream_id, self.headers]
        return [Kind.STREAM_CLOSE, self.stream_id]


StreamMessage = StreamItem | StreamCredit | StreamEnd | StreamError | StreamClose

STREAM_KINDS = frozenset(
    int(k)
    for k in (
        Kind.STREAM_ITEM, Kind.STREAM_VALUE, Kind.STREAM_CREDIT, Kind.STREAM_END,
        Kind.STREAM_ERROR, Kind.STREAM_CLOSE,
    )
)  # fmt: skip


def _count(value: Any) -> int:
    # bool is an int subclass; a peer sending True for a count is broken.
    if type(value) is not int or value < 0:
        raise TypeError(f"expected a non-negative int, got {value!r}")
    return value


def decode_stream_message(fields: list[Any]) -> StreamMessage:
    """Build the stream message a received header array describes.

    Raises:
        RemoteProtocolError: the array is not a valid stream message.
    """
    kind = fields[0] if fields else None
    try:
        if kind in (Kind.STREAM_ITEM, Kind.STREAM_VALUE):
            return StreamItem(*decode_item(fields), plain=kind == Kind.STREAM_VALUE)
        if kind == Kind.STREAM_CREDIT:
            count = _count(fields[2])
            if count == 0:
                raise ValueError("a credit of 0 items")
            nbytes = _count(fields[3]) if len(fields) > 3 else 0
            return StreamCredit(_count(fields[1]), count, nbytes, optional_headers(fields, 4))
        if kind == Kind.STREAM_END:
            return StreamEnd(_count(fields[1]), _count(fields[2]), optional_headers(fields, 3))
        if kind == Kind.STREAM_ERROR:
            return StreamError(_count(fields[1]), _count(fields[2]), optional_headers(fields, 3))
        if kind == Kind.STREAM_CLOSE:
            return StreamClose(_count(fields[1]), optional_headers(fields, 2))
    except (IndexError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed stream header: {fields!r:.200}") from exc
    raise RemoteProtocolError(f"not a stream header: {fields[:1]!r}")


class ProducerFlow:
    """The producer's side of one stream's credit: it may send only what it was granted.

    The consumer grants ``window`` items (and ``window_bytes`` bytes) first, then what it
    consumed, so the producer is never more than ``window`` items ahead of the consumer.
    Credit is reserved (``take``) before the generator is advanced, so an item is produced
    only when it may be sent.

    Bytes are counted the same way with one difference: an item's size is known only once
    it is made, so the rule is that an item may be *made* while some byte credit is left,
    and its size is then charged in full (``byte_credit`` may go below 0). Holding a made
    item back until it fits would keep it in memory anyway, and an item larger than the
    whole window would never fit. So at most ``window_bytes`` plus one item are unconsumed,
    an item of any size still goes, and after a large one nothing follows until the
    consumer has taken enough.
    """

    __slots__ = ("byte_credit", "credit", "granted", "reserved", "sent")

    def __init__(self) -> None:
        self.credit = 0  # items that may be produced now
        self.byte_credit: int | None = None  # bytes that may be sent now (None: not counted)
        self.granted = False  # the first credit (the windows) arrived
        self.reserved = 0  # taken, not yet sent
        self.sent = 0  # items sent so far (the next item's number)

    def grant(self, count: int, nbytes: int = 0) -> None:
        """The consumer granted ``count`` more items and ``nbytes`` more bytes; a first grant
        of 0 bytes means the stream counts items only.

        Raises:
            RemoteProtocolError: ``count`` is not positive, ``nbytes`` negative, or bytes
                are granted on a stream that does not count them.
        """
        if count <= 0 or nbytes < 0:
            raise RemoteProtocolError(f"a credit of {count} items and {nbytes} bytes")
        if not self.granted:
            self.granted = True
            self.byte_credit = nbytes or None
        elif self.byte_credit is not None:
            self.byte_credit += nbytes
        elif nbytes:
            raise RemoteProtocolError(
                f"a credit of {nbytes} bytes on a stream without a byte window"
            )
        self.credit += count

    def take(self, most: int | None = None) -> int:
        """Reserve up to ``most`` (default: all) of the item credit; returns how many, 0 when
        the byte credit is spent. A burst of several items stops within ``byte_credit``
        itself (see ``Producers._steps``)."""
        if self.byte_credit is not None and self.byte_credit <= 0:
            return 0
        count = self.credit if most is None else min(most, self.credit)
        self.credit -= count
        self.reserved += count
        return count

    def give_back(self) -> None:
        """The reserved credit that was not used (the generator ended or stopped first)."""
        self.credit += self.reserved
        self.reserved = 0

    def sent_one(self, nbytes: int = 0) -> int:
        """Number the next item, of ``nbytes`` bytes, using one reserved credit.

        Raises:
            LocalProtocolError: no credit was reserved for it (a bug here).
        """
        if self.reserved <= 0:
            raise LocalProtocolError(f"stream item {self.sent} sent without credit")
        self.reserved -= 1
        if self.byte_credit is not None:
            self.byte_credit -= nbytes
        seq = self.sent
        self.sent += 1
        return seq


class ConsumerFlow:
    """The consumer's side of one stream's credit: which items may come, when to grant more.

    ``check`` accepts each item's number (in order, exactly once, within the windows);
    ``consumed`` counts the items the application took and returns the credit to send, in
    batches of half a window (one credit frame per half window, not per item). That never
    leaves the producer stuck: it stops only with a whole window of items, or of bytes,
    unacknowledged, and once the consumer has taken those, at least half of that window is
    owed and granted.
    """

    __slots__ = (
        "_owed", "_owed_bytes", "_sizes", "acked", "acked_bytes", "received", "received_bytes",
        "window", "window_bytes",
    )  # fmt: skip

    def __init__(self, window: int, window_bytes: int = 0) -> None:
        if window < 1 or window_bytes < 0:
            raise LocalProtocolError(f"a stream window of {window} items and {window_bytes} bytes")
        self.window = window
        self.window_bytes = window_bytes  # 0: bytes are not counted
        self.received = 0  # items received (the next item's number)
        self.acked = 0  # items the producer was told were consumed
        self._owed = 0  # consumed, not yet reported
        self.received_bytes = self.acked_bytes = self._owed_bytes = 0  # the same, in bytes
        # The sizes of the items received and not yet consumed, oldest first: items are
        # consumed in order, so the bytes of ``count`` consumed items are the first ones.
        self._sizes: deque[int] = deque()

    def initial(self) -> tuple[int, int]:
        """The first credit: whole windows (items, bytes; 0 bytes: not counted)."""
        return self.window, self.window_bytes

    def check(self, seq: int, nbytes: int = 0) -> None:
        """Accept item number ``seq`` of ``nbytes`` bytes.

        Raises:
            RemoteProtocolError: out of order, repeated, or beyond the granted windows.
        """
        if seq != self.received:
            raise RemoteProtocolError(f"stream item {seq} arrived, expected {self.received}")
        if self.received - self.acked >= self.window:
            raise RemoteProtocolError(
                f"stream item {seq} exceeds the window of {self.window} items"
            )
        if self.window_bytes:
            # The producer may make an item while its byte credit is above 0; its view of
            # the credit lags ours (our grants are on the way), never leads it.
            if self.received_bytes - self.acked_bytes >= self.window_bytes:
                raise RemoteProtocolError(
                    f"stream item {seq} exceeds the window of {self.window_bytes} bytes"
                )
            self.received_bytes += nbytes
            self._sizes.append(nbytes)
        self.received += 1

    def consumed(self, count: int) -> tuple[int, int]:
        """The application took ``count`` more items; returns the credit to grant now
        (items, bytes; ``(0, 0)``: none yet).

        Raises:
            LocalProtocolError: more consumed than received (a bug here).
        """
        self._owed += count
        if self.acked + self._owed > self.received:
            raise LocalProtocolError(
                f"consumed {self.acked + self._owed} stream items of {self.received}"
            )
        sizes = self._sizes
        for _ in range(count if self.window_bytes else 0):
            self._owed_bytes += sizes.popleft()
        if self._owed < max(1, self.window // 2) and (
            not self.window_bytes or self._owed_bytes < max(1, self.window_bytes // 2)
        ):
            return 0, 0
        grant, self._owed = self._owed, 0
        grant_bytes, self._owed_bytes = self._owed_bytes, 0
        self.acked += grant
        self.acked_bytes += grant_bytes
        return grant, grant_bytes

    def check_end(self, count: int) -> None:
        """The producer says it sent ``count`` items.

        Raises:
            RemoteProtocolError: that is not how many arrived.
        """
        if count != self.received:
            raise RemoteProtocolError(f"stream ended after {count} items, {self.received} arrived")
