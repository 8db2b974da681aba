"""The W3C trace context read from a peer's header: exact, capped, never trusted."""

from __future__ import annotations

import pytest

from asyncrpc.observe import traceparent
from asyncrpc.observe.traceparent import MAX_TRACESTATE, TraceParent, decode, encode

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_round_trip() -> None:
    value = encode(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert value == GOOD
    assert decode(value) == TraceParent(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1, ""
    )
    assert decode(encode(5, 6, 0, "k=v")) == TraceParent(5, 6, 0, "k=v")


@pytest.mark.parametrize(
    "value",
    [
        None, 7, b"00", [], [GOOD], [GOOD, "a", "b"], {"traceparent": GOOD},
        GOOD.upper(), GOOD + "0", GOOD[:-1], "01" + GOOD[2:], "ff" + GOOD[2:],
        "00-" + "0" * 32 + "-b7ad6b7169203331-01", GOOD[:36] + "0" * 16 + "-01",
        GOOD.replace("-", "_"), "x" * 10_000,
    ],
)  # fmt: skip
def test_traceparent_refuses_what_is_not_one(value: object) -> None:
    assert decode(value) is None


def test_traceparent_caps_tracestate() -> None:
    long = "k=" + "v" * MAX_TRACESTATE
    assert encode(1, 2, 1, long) == encode(1, 2, 1)  # not sent
    assert decode([GOOD, long]) == decode(GOOD)  # not read
    assert decode([GOOD, 5]) == decode(GOOD)
    assert traceparent.FIELD == "tc"
