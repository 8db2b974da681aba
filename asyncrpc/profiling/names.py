"""Names of RPC spans in profiler traces, in torch's format (layer L3).

torch names an RPC ``rpc_<mode>#<function>(<caller> -> <callee>)`` and the events that ran
on the callee ``<that name>#remote_op: <event>``, where ``<function>`` is the operator's
name for a torch builtin (``aten::add``), the qualified name of a TorchScript function, and
the ``__qualname__`` of any other function. Ours are the same, so tools (and tests) written
for torch's traces read ours.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.jit._builtins import _find_builtin

__all__ = [
    "REMOTE_OP",
    "call_name",
    "function_name",
    "is_torch_op",
    "remote_event_name",
    "rpc_span_name",
    "stream_items_name",
]

REMOTE_OP = "#remote_op: "
"""What joins an RPC span's name to the name of an event its callee ran:
``rpc_sync#fn(a -> b)#remote_op: aten::mm``, as torch names remote events."""

# Calls an RRef makes for itself, under their names in torch's traces. torch asks the
# owner for the type of an RRef's value with an RPC of its function _rref_typeof_on_owner.
_TORCH_NAMES = {"RRef._get_type": "_rref_typeof_on_owner"}


def function_name(fn: Any) -> str:
    """What torch calls ``fn`` in a span name: ``aten::add``, ``my_func``, ``Cls.method``."""
    builtin = _find_builtin(fn)
    if builtin is not None:
        return str(builtin)
    if isinstance(fn, torch.jit.ScriptFunction):
        return str(fn.qualified_name)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def is_torch_op(fn: Any) -> bool:
    """Whether ``fn`` is a torch builtin (``torch.add``): the profiler names it itself."""
    return _find_builtin(fn) is not None


def call_name(target: str, default: str, fn: Any) -> str:
    """The span's function name of a call to ``fn`` named ``target`` (``default`` when the
    caller gave it no name of its own)."""
    if target == default:
        return function_name(fn)
    return _TORCH_NAMES.get(target, target)


def rpc_span_name(kind: str, function: str, caller: str, callee: str) -> str:
    """The name of an RPC's span in the caller's profile, as torch names it.

    Args:
        kind: how the call was made (a ``CallKind``, torch's word as its value).
        function: the function's name (``aten::add``, a ``__qualname__``).
        caller: the calling worker's name.
        callee: the called worker's name.

    Returns:
        ``rpc_{kind}#{function}({caller} -> {callee})``, e.g. ``rpc_sync#fn(a -> b)``.
    """
    return f"rpc_{kind}#{function}({caller} -> {callee})"


def stream_items_name(count: int) -> str:
    """The event a stream's span holds to say how many items it carried."""
    return f"stream items: {count}"


def remote_event_name(span: str, event: str) -> str:
    """The caller's name for ``event``, which ran on the callee of the RPC ``span``.

    Args:
        span: the RPC's span name (``rpc_span_name``).
        event: the name of the event on the callee (``aten::mm``).

    Returns:
        ``{span}#remote_op: {event}``.
    """
    return f"{span}{REMOTE_OP}{event}"
