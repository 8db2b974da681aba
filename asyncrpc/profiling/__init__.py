"""Profiling RPCs with torch's profiler (layer L3): a call pipeline hook and its API.

Inside ``torch.profiler.profile()``, ``torch.autograd.profiler.profile()`` or the legacy
``torch.autograd.profiler_legacy.profile()``, every RPC this process makes is a span named
like torch's (``rpc_sync#fn(caller -> callee)``, ``rpc_async#...``, ``rpc_remote#...``)
covering the time until its future completes, and what the callee ran comes back with the
reply, named ``<span>#remote_op: <event>``, with the callee's rank as ``node_id``.
``enable_server_profiler`` / ``disable_server_profiler`` / ``server_profile`` record every
request a worker serves.
"""

from __future__ import annotations

from asyncrpc.profiling.hook import ProfilingHook
from asyncrpc.profiling.names import REMOTE_OP, remote_event_name, rpc_span_name
from asyncrpc.profiling.server import (
    disable_server_profiler,
    enable_server_profiler,
    server_profile,
)

__all__ = [
    "REMOTE_OP",
    "ProfilingHook",
    "disable_server_profiler",
    "enable_server_profiler",
    "remote_event_name",
    "rpc_span_name",
    "server_profile",
]
