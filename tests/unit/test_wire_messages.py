"""Unit tests of asyncrpc.protocol.wire.messages: header arrays to messages and back."""

from __future__ import annotations

import math
from typing import Any

import pytest

from asyncrpc.errors import RemoteProtocolError
from asyncrpc.protocol.wire.messages import CallMode, RefMessage, Request, decode_message


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
