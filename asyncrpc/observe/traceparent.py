"""The W3C trace context as it rides in a request's header field (layer L3, no I/O).

A traced call's request carries its client span's ``traceparent`` (W3C Trace Context,
version 00), and the ``tracestate`` when there is one: a string, or a list of the two.
A peer's header is untrusted input: it is read with caps (exact lengths, lowercase hex,
a bounded ``tracestate``) and turned into numbers, never unpickled nor evaluated; a field
that fails any check is ignored, so the callee's span starts a new trace.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["FIELD", "MAX_TRACESTATE", "TraceParent", "decode", "encode"]

FIELD = "tc"  # the header field the tracing hook owns
# W3C caps tracestate at 32 members of at most 256 characters; 512 characters keeps a
# few vendors' entries and bounds what a peer makes us parse per request.
MAX_TRACESTATE = 512
_TRACEPARENT_LEN = 55  # "00-" 32 hex "-" 16 hex "-" 2 hex
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


class TraceParent(NamedTuple):
    """A span context from a peer: its trace, its span (our parent), its flags."""

    trace_id: int
    span_id: int
    flags: int
    tracestate: str


def encode(trace_id: int, span_id: int, flags: int, tracestate: str = "") -> str | list[str]:
    """The header field's value for a span (``tracestate`` longer than the cap is left out)."""
    parent = f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
    if tracestate and len(tracestate) <= MAX_TRACESTATE:
        return [parent, tracestate]
    return parent


def decode(value: object) -> TraceParent | None:
    """The span context in a header field's value; None if it is not a valid one."""
    tracestate = ""
    if isinstance(value, list) and len(value) == 2:
        value, state = value
        if isinstance(state, str) and len(state) <= MAX_TRACESTATE:
            tracestate = state
    if not isinstance(value, str) or len(value) != _TRACEPARENT_LEN:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if trace_id == 0 or span_id == 0:  # W3C: all zeros is invalid
        return None
    return TraceParent(trace_id, span_id, int(match[3], 16), tracestate)
