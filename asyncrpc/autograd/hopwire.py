"""A backward hop's own wire format: its request and reply without pickle (layer L3,
sans-I/O).

A hop's request is a few integers and lists of gradients; its reply an integer, or
gradients and an integer. Pickled, each side paid for a pickler or unpickler object, a
call back into Python per tensor and a module lookup for the function and for each
tensor's rebuild: about 7 µs a message warm and 20-30 µs between two messages, when the
code is cold (bench/RESULTS.md, "The backward hop against its floors"). Here the shape is
fixed: one msgpack array, gradients as the packed bytes a small tensor pickles to (the same
layout, ``serde.tensors``) or, past the inline size, as raw segments beside the payload, as
the pickled path sends them.

Only what this format can say exactly is sent this way: plain dense CPU tensors that do
not require grad, or None. Anything else (a CUDA or sparse gradient, a tensor subclass)
makes ``dump_*`` return None, and the hop goes pickled as any other call.

Request: ``[context_id, caller, credit | nil, batches]`` with ``credit = [root, pass_id,
amount]`` and ``batches = [[message_id, [gradient, ...]], ...]``; a gradient is nil, the
bytes of a small tensor, or ``[segment, dtype, shape, stride, offset]``. Reply: the credit
handed back (an int), or ``[batches, amount]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.coded import Coded
from asyncrpc.protocol.serde import Segment
from asyncrpc.protocol.serde.tensors import (
    SMALL_TENSOR_BYTES,
    TENSOR_PID,
    export_tensor,
    import_tensor,
    rebuild_small_tensor,
    reduce_small_tensor,
)

__all__ = ["dump_hop", "dump_hop_reply", "load_hop", "load_hop_reply"]

# A hop's arguments as the engine calls it: (context_id, batches, credit, caller).
HopArgs = tuple[int, list[tuple[int, list[Any]]], tuple[int, int, int] | None, int]

_Tensor = torch.Tensor
_STRIDED = torch.strided


class _NotCodable(Exception):
    """A value this format cannot say exactly: the hop goes pickled instead."""


def dump_hop(args: HopArgs) -> Coded | None:
    """A hop's request, or None where a gradient is not a plain dense CPU tensor."""
    context_id, batches, credit, caller = args
    segments: list[Segment] = []
    keep: list[object] = []
    try:
        coded = _dump_batches(batches, segments, keep)
    except _NotCodable:
        return None
    wire_credit = None if credit is None else list(credit)
    return msgpack.packb([context_id, caller, wire_credit, coded]), segments, keep


def load_hop(payload: Any, owners: Sequence[object]) -> HopArgs:
    """The arguments ``dump_hop`` coded; ``owners``: the received segments, in order.

    Raises:
        SerializationError: the payload is not a hop's request.
    """
    fields = _unpack(payload)
    if not (isinstance(fields, list) and len(fields) == 4):
        raise SerializationError("a backward hop's request is not a 4-field array")
    context_id, caller, credit, batches = fields
    _check_ints(context_id, caller)
    if credit is not None:
        if not (isinstance(credit, list) and len(credit) == 3):
            raise SerializationError("a backward hop's credit is not 3 integers")
        _check_ints(*credit)
        credit = (credit[0], credit[1], credit[2])
    return context_id, _load_batches(batches, owners), credit, caller


def dump_hop_reply(value: Any) -> Coded | None:
    """A hop's reply (the credit handed back, or gradients and their credit), or None
    where it holds what this format cannot say."""
    if type(value) is int:
        return msgpack.packb(value), [], []
    if not (isinstance(value, tuple) and len(value) == 2 and type(value[1]) is int):
        return None
    segments: list[Segment] = []
    keep: list[object] = []
    try:
        coded = _dump_batches(value[0], segments, keep)
    except _NotCodable:
        return None
    return msgpack.packb([coded, value[1]]), segments, keep


def load_hop_reply(payload: Any, owners: Sequence[object]) -> Any:
    """The reply ``dump_hop_reply`` coded.

    Raises:
        SerializationError: the payload is not a hop's reply.
    """
    fields = _unpack(payload)
    if type(fields) is int:
        return fields
    if not (isinstance(fields, list) and len(fields) == 2):
        raise SerializationError("a backward hop's reply is neither credit nor gradients")
    _check_ints(fields[1])
    return _load_batches(fields[0], owners), fields[1]


def _dump_batches(
    batches: list[tuple[int, list[Any]]], segments: list[Segment], keep: list[object]
) -> list[Any]:
    if not isinstance(batches, list):
        raise _NotCodable
    coded = []
    for message_id, grads in batches:
        if type(message_id) is not int or not isinstance(grads, list):
            raise _NotCodable
        coded.append([message_id, [_dump_grad(grad, segments, keep) for grad in grads]])
    return coded


def _dump_grad(grad: Any, segments: list[Segment], keep: list[object]) -> Any:
    if grad is None:
        return None
    if (
        type(grad) is not _Tensor
        or grad.requires_grad
        or grad.layout is not _STRIDED
        or not grad.is_cpu
        or grad.is_quantized
    ):
        raise _NotCodable
    if grad.numel() * grad.element_size() <= SMALL_TENSOR_BYTES:
        return reduce_small_tensor(grad)[1][0]
    exported = export_tensor(grad, len(segments))
    if exported is None:
        raise _NotCodable
    descriptor, segment, held = exported
    segments.append(segment)
    keep.append(held)
    _, index, dtype, shape, stride, offset = descriptor[:6]
    return [index, dtype, list(shape), list(stride), offset]


def _load_batches(batches: Any, owners: Sequence[object]) -> list[tuple[int, list[Any]]]:
    if not isinstance(batches, list):
        raise SerializationError("a backward hop's batches are not an array")
    loaded = []
    for batch in batches:
        if not (isinstance(batch, list) and len(batch) == 2 and isinstance(batch[1], list)):
            raise SerializationError("a backward hop's batch is not [message id, gradients]")
        _check_ints(batch[0])
        loaded.append((batch[0], [_load_grad(grad, owners) for grad in batch[1]]))
    return loaded


def _load_grad(grad: Any, owners: Sequence[object]) -> Any:
    if grad is None:
        return None
    if isinstance(grad, bytes):
        return rebuild_small_tensor(grad)
    if not (isinstance(grad, list) and len(grad) == 5):
        raise SerializationError("a backward hop's gradient is malformed")
    index, dtype, shape, stride, offset = grad
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)):
        raise SerializationError("a backward hop's gradient has a malformed layout")
    _check_ints(index, offset, *shape, *stride)
    if not (isinstance(dtype, str) and 0 <= index < len(owners)):
        raise SerializationError(f"a backward hop's gradient names segment {index!r}")
    descriptor = (TENSOR_PID, index, dtype, tuple(shape), tuple(stride), offset, False, False,
                  "cpu")  # fmt: skip
    try:
        return import_tensor(descriptor, owners[index])
    except RuntimeError as exc:  # a shape or stride past the segment's end
        raise SerializationError(f"a backward hop's gradient does not fit: {exc}") from exc


def _unpack(payload: Any) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise SerializationError(f"a backward hop's payload is not msgpack: {exc}") from exc


def _check_ints(*values: Any) -> None:
    for value in values:
        if type(value) is not int:
            raise SerializationError(f"a backward hop's field {value!r} is not an integer")
