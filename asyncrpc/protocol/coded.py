"""Calls with a wire format of their own: the library's hot internal calls, not pickled
(layer L1, sans-I/O: what the runtime needs to know of one).

A feature may name a function it calls very often whose arguments and result have a fixed
shape (distributed autograd's backward hop): a ``CodedCall`` pairs it with a codec. Such a
call goes on the calling thread's lane as a ``CallMode.CODED`` request whose target is the
call's name; the callee's lane thread finds the call by that name among those its own
features brought (never any other function: the name is not a reference to look up),
decodes the arguments, runs the function there and codes the reply, marked with the
``CODED_REPLY`` header field. A value the codec cannot say exactly (``dump_*`` returns
None) goes the ordinary way: the arguments make a pickled call of the same function, the
result a pickled reply without the mark, which the caller unpickles as any.

Hooks see coded calls as they see plain ones, or the call is not coded: a caller with an
active hook sends it pickled, and a callee whose hooks serve every request runs it through
them and replies pickled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrpc.protocol.serde import Segment

__all__ = ["Coded", "CodedCall"]

# (payload, segments, what keeps the segments' memory alive until they are written)
Coded = tuple[bytes, list[Segment], list[object]]


@dataclass(frozen=True, slots=True)
class CodedCall:
    """A function and the codec of its arguments and result.

    Attributes:
        name: the request's target, unique among the calls of a worker's features.
        run: the function; a plain one, run on the callee's lane thread (it may block).
        dump_args: the arguments' payload and segments, or None (send it pickled).
        load_args: ``(payload, segment owners)`` -> the arguments; raises
            ``SerializationError`` on a malformed payload.
        dump_result: the result's payload and segments, or None (reply pickled).
        load_result: ``(payload, segment owners)`` -> the result; raises as ``load_args``.
        after_reply: called with the arguments on the serving thread once the reply (or
            the error) is written: work the caller need not wait for. None: nothing.
    """

    name: str
    run: Callable[..., Any]
    dump_args: Callable[[Any], Coded | None]
    load_args: Callable[[Any, Sequence[object]], Any]
    dump_result: Callable[[Any], Coded | None]
    load_result: Callable[[Any, Sequence[object]], Any]
    after_reply: Callable[..., None] | None = None
