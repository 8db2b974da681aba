"""Unit tests of asyncrpc.protocol.wire.stream: stream frames and the credit machines."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    decode_item,
    decode_stream_message,
    encode_item,
    item_fields,
)

MESSAGES = [
    StreamItem(7, 0),
    StreamItem(1 << 40, 99, 64 << 20),
    StreamItem(7, 1, 12, {"ag": [3, 9]}),  # an item with the pipeline's fields
    StreamItem(7, 2, 5, None, plain=True),  # a plain pickle of a scalar: STREAM_VALUE
    StreamItem(7, 3, 5, {"cs": {"r": [1]}}, plain=True),
    StreamCredit(7, 64),
    StreamCredit(7, 64, 1 << 40),
    StreamCredit(7, 64, 0, {"cs": {"r": [1, 2]}}),  # the pipeline's fields, no byte window
    StreamCredit(7, 64, 9, {"cs": {"r": [1]}}),
    StreamEnd(7, 100),
    StreamEnd(7, 100, {"p": [[1, 2]]}),
    StreamError(7, 3),
    StreamError(7, 3, {"p": []}),
    StreamClose(7),
    StreamClose(7, {"cs": {"r": [4]}}),
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
        [Kind.STREAM_ITEM, 1, 0],  # no size
        [Kind.STREAM_ITEM, 1, -1, 0],
        [Kind.STREAM_ITEM, 1, 0, -5],
        [Kind.STREAM_ITEM, 1, 0, 5, "not a map"],
        [Kind.STREAM_ITEM, 1, 0, 5, {1: "keys are strings"}],
        [Kind.STREAM_CREDIT, 1, 4, -1],
        [Kind.STREAM_ITEM, True, 0, 0],  # a bool is not an id
        [Kind.STREAM_CREDIT, 1, 0],  # a credit of nothing
        [Kind.STREAM_CREDIT, 1, 1.5],
        [Kind.STREAM_END, 1, 2, "not a map"],
        [Kind.STREAM_ERROR, "1", 2],
        [Kind.STREAM_CLOSE],
        [Kind.STREAM_CREDIT, 1, 4, 0, ["not a map"]],
        [Kind.STREAM_CLOSE, 1, {2: "keys are strings"}],
        [Kind.REPLY, 1],  # not a stream kind
        [],
    ],
)
def test_decode_stream_message_rejects_malformed_headers(fields: list[Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_stream_message(fields)
    if fields[:1] == [Kind.STREAM_ITEM]:  # the consumer's path for items checks the same
        with pytest.raises(RemoteProtocolError):
            decode_item(fields)


@pytest.mark.parametrize("payload", [b"", b"\x80\x05K\x07.", b"x" * 70_000])
def test_encode_item_frames_as_encode_frame_does(payload: bytes) -> None:
    packer = msgpack.Packer()
    for seq in range(3):  # one packer for a stream's items, one after another
        item = StreamItem(7, seq, len(payload), plain=True)
        pieces, size = encode_item(packer, item.to_fields(), payload)
        assert pieces == encode_frame(item.to_fields(), payload)
        assert size == sum(len(p) for p in pieces)
        (frame,) = FrameDecoder().feed(b"".join(pieces))
        assert decode_stream_message(frame.fields) == StreamItem(7, seq, len(payload), plain=True)
    with pytest.raises(LocalProtocolError):
        encode_item(packer, [Kind.STREAM_VALUE, object()], b"")
    pieces, _ = encode_item(packer, item.to_fields(), payload)  # the failure left nothing
    assert pieces == encode_frame(item.to_fields(), payload)


@pytest.mark.parametrize("item", [m for m in MESSAGES if isinstance(m, StreamItem)], ids=repr)
def test_item_fields_and_decode_item_agree_with_StreamItem(item: StreamItem) -> None:
    fields = item_fields(item.stream_id, item.seq, item.nbytes, item.headers, item.plain)
    assert fields == item.to_fields()
    assert fields[0] == (Kind.STREAM_VALUE if item.plain else Kind.STREAM_ITEM)
    assert StreamItem(*decode_item(fields), plain=item.plain) == item


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
    assert flow.consumed(2) == (2, 0)
    flow.check(2)


def test_ConsumerFlow_grants_in_batches_of_half_a_window() -> None:
    flow = ConsumerFlow(window=8)
    assert flow.initial() == (8, 0)
    for seq in range(8):
        flow.check(seq)
    assert flow.consumed(3) == (0, 0)  # below half a window: held back
    assert flow.consumed(1) == (4, 0)
    assert flow.acked == 4


def test_ConsumerFlow_windows_of_one_and_two_grant_every_item() -> None:
    for window in (1, 2):
        flow = ConsumerFlow(window)
        flow.check(0)
        assert flow.consumed(1) == (1, 0)
        assert flow.consumed(0) == (0, 0)


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
    producer.grant(*consumer.initial())
    for consumed in range(1, 51):
        while producer.take(1):
            consumer.check(producer.sent_one())
            assert producer.sent - (consumed - 1) <= window
        grant = consumer.consumed(1)
        if grant[0]:
            producer.grant(*grant)
    assert producer.sent >= 50


# -- byte credit -----------------------------------------------------------------------------


def test_ProducerFlow_stops_when_its_byte_credit_is_spent() -> None:
    flow = ProducerFlow()
    flow.grant(100, 10)
    assert flow.take(1) == 1
    flow.sent_one(4)
    assert flow.take(1) == 1
    flow.sent_one(7)  # made while 6 bytes were left: charged in full
    assert flow.byte_credit == -1
    assert flow.take() == 0  # items left, bytes not
    flow.grant(1, 4)
    assert flow.take(1) == 1


def test_ProducerFlow_sends_an_item_larger_than_the_byte_window_alone() -> None:
    flow = ProducerFlow()
    flow.grant(8, 10)
    assert flow.take(1) == 1
    flow.sent_one(1000)
    assert flow.take() == 0  # nothing follows it until it is consumed
    flow.grant(1, 1000)
    assert flow.byte_credit == 10
    assert flow.take(1) == 1


def test_ProducerFlow_counts_bytes_only_when_its_first_credit_grants_them() -> None:
    flow = ProducerFlow()
    flow.grant(2)
    assert flow.byte_credit is None
    assert flow.take() == 2
    flow.sent_one(1 << 40)
    assert flow.take() == 0  # the item credit is spent, not a byte credit
    with pytest.raises(RemoteProtocolError):
        flow.grant(1, 5)  # bytes on a stream that does not count them
    with pytest.raises(RemoteProtocolError):
        ProducerFlow().grant(1, -1)


def test_ConsumerFlow_refuses_an_item_past_the_byte_window() -> None:
    flow = ConsumerFlow(window=100, window_bytes=10)
    assert flow.initial() == (100, 10)
    flow.check(0, 6)
    flow.check(1, 6)  # made with 4 bytes of credit left: allowed
    with pytest.raises(RemoteProtocolError):
        flow.check(2, 1)  # made with none left
    assert flow.consumed(1) == (1, 6)  # half the byte window owed: granted at once
    flow.check(2, 1)


def test_ConsumerFlow_grants_at_half_a_byte_window_or_half_an_item_window() -> None:
    flow = ConsumerFlow(window=8, window_bytes=100)
    for seq, size in enumerate([10, 10, 10, 40, 1, 1, 1, 1]):
        flow.check(seq, size)
    assert flow.consumed(3) == (0, 0)  # 3 items, 30 bytes: below both halves
    assert flow.consumed(1) == (4, 70)  # 70 bytes >= 50
    assert flow.consumed(3) == (0, 0)
    assert flow.consumed(1) == (4, 4)  # 4 items >= half of 8
    assert (flow.acked, flow.acked_bytes) == (8, 74)


def test_flows_bound_64_MiB_items_to_4_in_a_256_MiB_window() -> None:
    # The figure: tensor items of 64 MiB (plus their pickle) and a stalled
    # consumer: the producer makes 4 and stops until one is consumed, whatever the item
    # window.
    size = (64 << 20) + 300
    producer, consumer = ProducerFlow(), ConsumerFlow(window=128, window_bytes=256 << 20)
    producer.grant(*consumer.initial())
    made = 0
    while producer.take(1):
        consumer.check(producer.sent_one(size), size)
        made += 1
    assert made == 4
    assert consumer.consumed(2) == (2, 2 * size)  # half the byte window: granted
    producer.grant(2, 2 * size)
    while producer.take(1):
        consumer.check(producer.sent_one(size), size)
        made += 1
    assert made == 6  # again 4 unconsumed


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(1, 9),
    window_bytes=st.integers(0, 400),
    sizes=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    data=st.data(),
)
def test_flows_bound_bytes_and_items_in_flight_and_never_stall(
    window: int, window_bytes: int, sizes: list[int], data: st.DataObject
) -> None:
    # Both machines with frames in transit both ways, in an order hypothesis picks: the
    # producer makes an item only within both windows, the consumer never refuses what it
    # makes, and the stream always finishes (no state where nothing can move).
    producer, consumer = ProducerFlow(), ConsumerFlow(window, window_bytes)
    producer.grant(*consumer.initial())
    items: list[tuple[int, int]] = []  # producer -> consumer, in order
    credits: list[tuple[int, int]] = []  # consumer -> producer, in order
    made = taken = 0  # the producer's items, the consumer's items taken (in order)
    unconsumed_bytes = 0  # bytes made, not yet taken
    received = 0
    while taken < len(sizes):
        moves = []
        if made < len(sizes) and producer.take(1):
            producer.give_back()
            moves.append("make")
        if items:
            moves.append("deliver")
        if credits:
            moves.append("credit")
        if received > taken:
            moves.append("consume")
        assert moves, "the stream stalled"
        move = data.draw(st.sampled_from(moves))
        if move == "make":
            assert producer.take(1) == 1
            if window_bytes:
                assert unconsumed_bytes < window_bytes  # credit left when it was made
            size = sizes[made]
            items.append((producer.sent_one(size), size))
            made += 1
            unconsumed_bytes += size
            assert made - taken <= window
        elif move == "deliver":
            consumer.check(*items.pop(0))
            received += 1
        elif move == "credit":
            producer.grant(*credits.pop(0))
        else:
            count = data.draw(st.integers(1, received - taken))
            unconsumed_bytes -= sum(sizes[taken : taken + count])
            taken += count
            grant = consumer.consumed(count)
            if grant[0]:
                credits.append(grant)
