"""Names of RPC spans in profiler traces, in torch's format (layer L3).

torch names an RPC ``rpc_<mode>#<function>(<caller> -> <callee>)`` and the events that ran
on the callee ``<that name>#remote_op: <event>``; tools written for torch's traces read
ours the same way.
"""

from __future__ import annotations

__all__ = ["REMOTE_OP", "remote_event_name", "rpc_span_name"]

REMOTE_OP = "#remote_op: "


def rpc_span_name(kind: str, target: str, caller: str, callee: str) -> str:
    """``rpc_sync#module.fn(caller -> callee)``; ``kind`` is "sync", "async" or "remote"."""
    return f"rpc_{kind}#{target}({caller} -> {callee})"


def remote_event_name(span: str, event: str) -> str:
    """The caller's name for ``event``, which ran on the callee of the RPC ``span``."""
    return f"{span}{REMOTE_OP}{event}"
