"""Which calls of builtin torch ops a worker runs on its event loop, not its pool (layer L2.4).

A small elementwise op runs in a few microseconds, but on the thread pool it pays two
thread hand-offs (tens of microseconds each on a VM). An op from the list below, called on
small dense CPU tensors and plain numbers only, runs on the loop as an ``@inline`` function
does. The list holds ops whose work is bounded by the size of their inputs and output
(elementwise ops and full reductions), and the output's size is bounded by checking the
broadcast shape; ops that make tensors from sizes (``torch.ones(n)``) or whose cost grows
faster than their inputs (``torch.mm``) stay on the pool.
"""

from __future__ import annotations

import math
import types
from typing import Any, Final

import torch

from asyncrpc.errors import OperatorArgumentsError

__all__ = ["SMALL_OP_NUMEL", "checked_op", "is_torch_c_function", "runs_on_loop"]

SMALL_OP_NUMEL: Final = 1 << 14
"""The most elements an argument, and the broadcast result, may have to run on the loop."""

_OPS: Final = frozenset(
    {
        torch.abs, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide,
        torch.floor_divide, torch.remainder, torch.fmod, torch.neg, torch.pow,
        torch.exp, torch.log, torch.log1p, torch.expm1, torch.sqrt, torch.rsqrt,
        torch.reciprocal, torch.square, torch.sign, torch.sin, torch.cos, torch.tan,
        torch.tanh, torch.sigmoid, torch.relu, torch.floor, torch.ceil, torch.round,
        torch.trunc, torch.clamp, torch.clip, torch.maximum, torch.minimum, torch.lerp,
        torch.where, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
        torch.logical_and, torch.logical_or, torch.logical_not, torch.isnan, torch.isfinite,
        torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.all, torch.any,
        torch.addcmul, torch.addcdiv,
    }
)  # fmt: skip
_BUILTIN: Final = types.BuiltinFunctionType
_NUMBERS: Final = frozenset({int, float, bool})
_TENSOR: Final = torch.Tensor
_STRIDED: Final = torch.strided


def runs_on_loop(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when ``fn(*args, **kwargs)`` is a small call of a bounded builtin torch op.

    Args:
        fn: the function a request names.
        args, kwargs: its arguments as received.

    Returns:
        Whether running it on the event loop costs less than the pool hand-off, with no
        risk of stalling the loop: an op from the list, with tensor arguments that are
        dense CPU tensors of at most ``SMALL_OP_NUMEL`` elements (as is the broadcast
        result), every other argument a plain number, and no ``out=``.
    """
    if type(fn) is not _BUILTIN or fn not in _OPS or "out" in kwargs:
        return False
    shapes = []
    for value in (*args, *kwargs.values()):
        if type(value) in _NUMBERS:
            continue
        if (
            type(value) is not _TENSOR
            or not value.is_cpu
            or value.layout is not _STRIDED
            or value.numel() > SMALL_OP_NUMEL
        ):
            return False
        shapes.append(value.shape)
    if len(shapes) > 1 and any(shape != shapes[0] for shape in shapes):
        try:
            result: torch.Size = torch.broadcast_shapes(*shapes)  # type: ignore[no-untyped-call]
        except RuntimeError:
            return True  # the op fails at once, wherever it runs
        return int(math.prod(result)) <= SMALL_OP_NUMEL
    return True


def is_torch_c_function(fn: Any) -> bool:
    """Whether ``fn`` is a C function of the ``torch`` module (``torch.add``...): its
    TypeErrors come from parsing its arguments (``profiling.names.is_torch_op`` is wider:
    any function torch maps to an operator)."""
    return type(fn) is _BUILTIN and getattr(fn, "__module__", None) == "torch"


def checked_op(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)``, where arguments it does not take raise
    ``OperatorArgumentsError`` (a TypeError, as locally, and torch RPC's RuntimeError).

    Raises:
        OperatorArgumentsError: the op's argument parser refused the arguments.
    """
    try:
        return op(*args, **kwargs)
    except TypeError as exc:  # a C function: its TypeErrors come from parsing arguments
        raise OperatorArgumentsError(
            f"Overloaded torch operator invoked from Python failed to match any schema: {exc}"
        ) from exc
