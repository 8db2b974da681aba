"""Stream frames: the items of a streaming call and their flow control (layer L1, sans-I/O).

A stream starts as a ``Request`` in ``CallMode.STREAM`` whose call id names the stream; the
caller then grants the producer its first credit. From then on, only these five frames
carry it, each naming its stream by that id:

  producer -> consumer: ``StreamItem`` (one item: payload and tensor segments, numbered
      from 0), then exactly one of ``StreamEnd`` (the generator finished after ``count``
      items) or ``StreamError`` (it raised after ``count`` items; the payload is the
      packed exception);
  consumer -> producer: ``StreamCredit`` (``count`` more items may be sent) and
      ``StreamClose`` (stop: the consumer is gone).

The credit rules (``ProducerFlow``, ``ConsumerFlow``) are pure state machines too, so both
sides' bookkeeping is unit-tested without a loop. Like every frame after ``Hello``, these
are refused before the handshake completes (the pre-auth decoder admits handshake kinds
only, and the agent routes them only on an authenticated connection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrpc.errors import LocalProtocolError, RemoteProtocolError
from asyncrpc.protocol.wire.messages import Kind, optional_headers

__all__ = [
    "STREAM_KINDS",
    "ConsumerFlow",
    "ProducerFlow",
    "StreamClose",
    "StreamCredit",
    "StreamEnd",
    "StreamError",
    "StreamItem",
    "StreamMessage",
    "decode_stream_message",
]


@dataclass(frozen=True, slots=True)
class StreamItem:
    """Item number ``seq`` (from 0) of stream ``stream_id``; the payload is its pickle."""

    stream_id: int
    seq: int

    def to_fields(self) -> list[Any]:
        return [Kind.STREAM_ITEM, self.stream_id, self.seq]


@dataclass(frozen=True, slots=True)
class StreamCredit:
    """The consumer may take ``count`` more items of ``stream_id`` (it consumed as many)."""

    stream_id: int
    count: int

    def to_fields(self) -> list[Any]:
        return [Kind.STREAM_CREDIT, self.stream_id, self.count]


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
    """The consumer of ``stream_id`` is gone: stop the producer and send nothing more."""

    stream_id: int

    def to_fields(self) -> list[Any]:
        return [Kind.STREAM_CLOSE, self.stream_id]


StreamMessage = StreamItem | StreamCredit | StreamEnd | StreamError | StreamClose

STREAM_KINDS = frozenset(
    int(k)
    for k in (
        Kind.STREAM_ITEM, Kind.STREAM_CREDIT, Kind.STREAM_END, Kind.STREAM_ERROR,
        Kind.STREAM_CLOSE,
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
        if kind == Kind.STREAM_ITEM:
            return StreamItem(_count(fields[1]), _count(fields[2]))
        if kind == Kind.STREAM_CREDIT:
            count = _count(fields[2])
            if count == 0:
                raise ValueError("a credit of 0 items")
            return StreamCredit(_count(fields[1]), count)
        if kind == Kind.STREAM_END:
            return StreamEnd(_count(fields[1]), _count(fields[2]), optional_headers(fields, 3))
        if kind == Kind.STREAM_ERROR:
            return StreamError(_count(fields[1]), _count(fields[2]), optional_headers(fields, 3))
        if kind == Kind.STREAM_CLOSE:
            return StreamClose(_count(fields[1]))
    except (IndexError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed stream header: {fields!r:.200}") from exc
    raise RemoteProtocolError(f"not a stream header: {fields[:1]!r}")


class ProducerFlow:
    """The producer's side of one stream's credit: it may send only what it was granted.

    The consumer grants ``window`` items first, then one credit per item it consumed, so
    the producer is never more than ``window`` items ahead of the consumer. Credit is
    reserved (``take``) before the generator is advanced, so an item is produced only
    when it may be sent.
    """

    __slots__ = ("credit", "reserved", "sent")

    def __init__(self) -> None:
        self.credit = 0  # items that may be produced now
        self.reserved = 0  # taken, not yet sent
        self.sent = 0  # items sent so far (the next item's number)

    def grant(self, count: int) -> None:
        """The consumer granted ``count`` more items.

        Raises:
            RemoteProtocolError: ``count`` is not positive.
        """
        if count <= 0:
            raise RemoteProtocolError(f"a credit of {count} items")
        self.credit += count

    def take(self, most: int | None = None) -> int:
        """Reserve up to ``most`` (default: all) of the credit; returns how many."""
        count = self.credit if most is None else min(most, self.credit)
        self.credit -= count
        self.reserved += count
        return count

    def give_back(self) -> None:
        """The reserved credit that was not used (the generator ended or stopped first)."""
        self.credit += self.reserved
        self.reserved = 0

    def sent_one(self) -> int:
        """Number the next item, using one reserved credit.

        Raises:
            LocalProtocolError: no credit was reserved for it (a bug here).
        """
        if self.reserved <= 0:
            raise LocalProtocolError(f"stream item {self.sent} sent without credit")
        self.reserved -= 1
        seq = self.sent
        self.sent += 1
        return seq


class ConsumerFlow:
    """The consumer's side of one stream's credit: which items may come, when to grant more.

    ``check`` accepts each item's number (in order, exactly once, within the window);
    ``consumed`` counts the items the application took and returns the credit to send, in
    batches of half a window (one credit frame per half window, not per item). That never
    leaves the producer stuck: it stops only with a whole window unacknowledged, and once
    the consumer has taken those, at least half a window is owed and granted.
    """

    __slots__ = ("_owed", "acked", "received", "window")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise LocalProtocolError(f"a stream window of {window} items")
        self.window = window
        self.received = 0  # items received (the next item's number)
        self.acked = 0  # items the producer was told were consumed
        self._owed = 0  # consumed, not yet reported

    def initial(self) -> int:
        """The first credit: a whole window."""
        return self.window

    def check(self, seq: int) -> None:
        """Accept item number ``seq``.

        Raises:
            RemoteProtocolError: out of order, repeated, or beyond the granted window.
        """
        if seq != self.received:
            raise RemoteProtocolError(f"stream item {seq} arrived, expected {self.received}")
        if self.received - self.acked >= self.window:
            raise RemoteProtocolError(
                f"stream item {seq} exceeds the window of {self.window} items"
            )
        self.received += 1

    def consumed(self, count: int) -> int:
        """The application took ``count`` more items; returns the credit to grant now (0:
        none yet).

        Raises:
            LocalProtocolError: more consumed than received (a bug here).
        """
        self._owed += count
        if self.acked + self._owed > self.received:
            raise LocalProtocolError(
                f"consumed {self.acked + self._owed} stream items of {self.received}"
            )
        if self._owed < max(1, self.window // 2):
            return 0
        grant, self._owed = self._owed, 0
        self.acked += grant
        return grant

    def check_end(self, count: int) -> None:
        """The producer says it sent ``count`` items.

        Raises:
            RemoteProtocolError: that is not how many arrived.
        """
        if count != self.received:
            raise RemoteProtocolError(f"stream ended after {count} items, {self.received} arrived")
