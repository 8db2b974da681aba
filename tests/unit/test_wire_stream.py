"""Unit tests of asyncrpc.protocol.wire.stream: stream frames and the credit machines."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.errors import LocalProtocolError, RemoteProtocolError
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Kind, decode_message
from asyncrpc.protocol.wire.stream import (
    STREAM_KINDS,
    ConsumerFlow,
    ProducerFlow,
    StreamClose,
    StreamCredit,
    StreamEnd,
    StreamError,
    StreamItem,
    decode_stream_message,
)

MESSAGES = [
    StreamItem(7, 0),
    StreamItem(1 << 40, 99),
    StreamCredit(7, 64),
    StreamEnd(7, 100),
    StreamEnd(7, 100, {"p": [[1, 2]]}),
    StreamError(7, 3),
    StreamError(7, 3, {"p": []}),
    StreamClose(7),
]


@pytest.mark.parametrize("message", MESSAGES, ids=repr)
def test_decode_stream_message_roundtrips(message: Any) -> None:
    assert decode_stream_message(message.to_fields()) == message
    assert message.to_fields()[0] in STREAM_KINDS


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_decode_stream_message_roundtrips_through_the_frame_decoder(chunk: int | None) -> None:
    pieces = encode_frame(
        StreamItem(3, 5).to_fields(), b"pickled item", [(memoryview(b"x" * 10), "cpu")]
    )
    data = b"".join(bytes(p) for p in pieces)
    decoder = FrameDecoder()
    frames = []
    step = chunk or len(data)
    for start in range(0, len(data), step):
        frames += decoder.feed(data[start : start + step])
    (frame,) = frames
    assert decode_stream_message(frame.fields) == StreamItem(3, 5)
    assert bytes(frame.payload) == b"pickled item"


@pytest.mark.parametrize(
    "fields",
    [
        [Kind.STREAM_ITEM, 1],  # no seq
        [Kind.STREAM_ITEM, 1, -1],
        [Kind.STREAM_ITEM, True, 0],  # a bool is not an id
        [Kind.STREAM_CREDIT, 1, 0],  # a credit of nothing
        [Kind.STREAM_CREDIT, 1, 1.5],
        [Kind.STREAM_END, 1, 2, "not a map"],
        [Kind.STREAM_ERROR, "1", 2],
        [Kind.STREAM_CLOSE],
        [Kind.REPLY, 1],  # not a stream kind
        [],
    ],
)
def test_decode_stream_message_rejects_malformed_headers(fields: list[Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_stream_message(fields)


def test_decode_message_leaves_stream_kinds_to_the_stream_module() -> None:
    # The agent routes stream kinds before decode_message: a stream frame on a connection
    # that has not finished its handshake reaches decode_message and is refused there.
    with pytest.raises(RemoteProtocolError):
        decode_message(StreamCredit(1, 1).to_fields())


def test_ProducerFlow_produces_only_within_its_credit() -> None:
    flow = ProducerFlow()
    assert flow.take() == 0  # nothing granted: the generator is not advanced
    flow.grant(3)
    assert flow.take(1) == 1
    assert flow.sent_one() == 0
    assert flow.take() == 2
    assert [flow.sent_one(), flow.sent_one()] == [1, 2]
    with pytest.raises(LocalProtocolError):
        flow.sent_one()  # a fourth item without credit


def test_ProducerFlow_gives_back_unused_reserved_credit() -> None:
    flow = ProducerFlow()
    flow.grant(4)
    assert flow.take() == 4
    flow.sent_one()
    flow.give_back()  # the burst stopped after one item
    assert (flow.credit, flow.reserved, flow.sent) == (3, 0, 1)
    with pytest.raises(RemoteProtocolError):
        flow.grant(0)


def test_ConsumerFlow_accepts_items_in_order_once() -> None:
    flow = ConsumerFlow(window=4)
    flow.check(0)
    flow.check(1)
    with pytest.raises(RemoteProtocolError):
        flow.check(1)  # repeated
    with pytest.raises(RemoteProtocolError):
        flow.check(3)  # a gap


def test_ConsumerFlow_refuses_items_beyond_the_window() -> None:
    flow = ConsumerFlow(window=2)
    flow.check(0)
    flow.check(1)
    with pytest.raises(RemoteProtocolError):
        flow.check(2)  # nothing consumed: the producer overran its credit
    assert flow.consumed(2) == 2
    flow.check(2)


def test_ConsumerFlow_grants_in_batches_of_half_a_window() -> None:
    flow = ConsumerFlow(window=8)
    assert flow.initial() == 8
    for seq in range(8):
        flow.check(seq)
    assert flow.consumed(3) == 0  # below half a window: held back
    assert flow.consumed(1) == 4
    assert flow.acked == 4


def test_ConsumerFlow_windows_of_one_and_two_grant_every_item() -> None:
    for window in (1, 2):
        flow = ConsumerFlow(window)
        flow.check(0)
        assert flow.consumed(1) == 1
        assert flow.consumed(0) == 0


def test_ConsumerFlow_checks_consumption_and_the_end_count() -> None:
    flow = ConsumerFlow(window=4)
    flow.check(0)
    with pytest.raises(LocalProtocolError):
        flow.consumed(2)
    with pytest.raises(RemoteProtocolError):
        flow.check_end(2)
    flow.check_end(1)
    with pytest.raises(LocalProtocolError):
        ConsumerFlow(window=0)


def test_flows_keep_the_producer_within_the_window() -> None:
    # Both machines together, with a consumer that takes one item per round: the producer
    # never has more than the window unacknowledged.
    window = 5
    producer, consumer = ProducerFlow(), ConsumerFlow(window)
    producer.grant(consumer.initial())
    for consumed in range(1, 51):
        while producer.take(1):
            consumer.check(producer.sent_one())
            assert producer.sent - (consumed - 1) <= window
        grant = consumer.consumed(1)
        if grant:
            producer.grant(grant)
    assert producer.sent >= 50
