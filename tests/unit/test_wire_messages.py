"""Unit tests of asyncrpc.protocol.wire.messages: header arrays to messages and back."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.protocol.wire.messages import (
    BarrierOpened,
    CallMode,
    ErrorReply,
    Hello,
    HelloReply,
    Kind,
    RefMessage,
    Refusal,
    Reply,
    Request,
    ShmMessage,
    ShmOp,
    coded_request_fields,
    decode_message,
)


def test_decode_message_roundtrips_the_frame_limit_of_the_handshake() -> None:
    hello = Hello(2, "w1", 1, b"n" * 16, 1 << 20)
    reply = HelloReply(2, "w0", 0, Refusal.NONE, "", b"m" * 16, b"p" * 32, 1 << 30)
    assert decode_message(hello.to_fields()) == hello
    assert decode_message(reply.to_fields()) == reply
    # Absent: 0, "not said" (the sender then checks nothing against it).
    assert decode_message(hello.to_fields()[:5]) == Hello(2, "w1", 1, b"n" * 16, 0)
    fields = hello.to_fields()
    fields[5] = -1
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)


def test_decode_message_roundtrips_a_request() -> None:
    request = Request(7, 1.5, int(CallMode.REMOTE), "mod.fn", (1, 2), (3, 4))
    assert decode_message(request.to_fields()) == request


@pytest.mark.parametrize(
    "timeout", [math.nan, math.inf, -1.0, "1", None], ids=["nan", "inf", "neg", "str", "none"]
)
def test_decode_message_rejects_bad_request_timeout(timeout: Any) -> None:
    fields = Request(7, 1.0, int(CallMode.CALL), "mod.fn").to_fields()
    fields[2] = timeout
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)


def test_decode_message_rejects_unknown_call_mode_and_ref_op() -> None:
    fields = Request(7, 1.0, int(CallMode.CALL), "mod.fn").to_fields()
    fields[3] = 99
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)
    ref = RefMessage(1, (0, 1), (2, 3)).to_fields()
    ref[1] = 99
    with pytest.raises(RemoteProtocolError):
        decode_message(ref)


def test_decode_message_request_headers_roundtrip_and_stay_off_when_empty() -> None:
    plain = Request(7, 1.0, CallMode.CALL, "m.f")
    assert len(plain.to_fields()) == 7
    assert len(Request(7, 1.0, CallMode.CALL, "m.f", headers={}).to_fields()) == 7
    with_fields = Request(7, 1.0, int(CallMode.CALL), "m.f", headers={"p": 1, "ag": [3, 4]})
    assert decode_message(with_fields.to_fields()) == with_fields
    for reply in (Reply(3, {"p": [["aten::mm", 0.0, 1.5, 9]]}), ErrorReply(3, {"x": 1})):
        assert decode_message(reply.to_fields()) == reply
    assert Reply(3).to_fields() == [Kind.REPLY, 3]
    assert ErrorReply(3, {}).to_fields() == [Kind.ERROR, 3]


@pytest.mark.parametrize("headers", [[1, 2], "p", {1: "x"}, None])
def test_decode_message_rejects_malformed_header_fields(headers: Any) -> None:
    fields = [*Request(7, 1.0, CallMode.CALL, "m.f").to_fields(), headers]
    if headers is None:
        fields = [Kind.REPLY, 3, None]
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)


def test_decode_message_shm_roundtrips_and_rejects_malformed() -> None:
    for op in ShmOp:
        message = ShmMessage(int(op), (1, 2, 3))
        assert decode_message(message.to_fields()) == message
    assert decode_message(ShmMessage(ShmOp.RELEASE, ()).to_fields()) == ShmMessage(3, ())
    for bad in (
        [Kind.SHM, 99, [1]],  # unknown op
        [Kind.SHM, ShmOp.RELEASE, 7],  # not a list
        [Kind.SHM, ShmOp.RELEASE, [1, "2"]],  # not integers
        [Kind.SHM, ShmOp.RELEASE, [True]],  # a bool is not an id
        [Kind.SHM, ShmOp.RELEASE],  # missing
    ):
        with pytest.raises(RemoteProtocolError):
            decode_message(bad)


def test_decode_message_barrier_opened_roundtrips_and_rejects_malformed() -> None:
    for message in (BarrierOpened("closing", 0), BarrierOpened("calls-done", 999, True)):
        assert decode_message(message.to_fields()) == message
    for bad in (
        [Kind.BARRIER_OPENED, "closing", 0],  # whether a rank died: missing
        [Kind.BARRIER_OPENED, "closing", True, False],  # a bool is not a rank
        [Kind.BARRIER_OPENED, 3, 0, False],  # the tag is a str
        [Kind.BARRIER_OPENED, "closing", 0, 1],  # dead is a bool
    ):
        with pytest.raises(RemoteProtocolError):
            decode_message(bad)


def test_coded_request_fields_are_a_coded_requests() -> None:
    fields = coded_request_fields(7, 2.5, "asyncrpc.autograd.hop")
    assert fields == Request(7, 2.5, CallMode.CODED, "asyncrpc.autograd.hop").to_fields()
    on_the_wire = msgpack.unpackb(msgpack.packb(fields))
    assert decode_message(on_the_wire) == Request(7, 2.5, CallMode.CODED, "asyncrpc.autograd.hop")
