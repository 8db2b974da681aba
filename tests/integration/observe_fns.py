"""Functions the observability tests run on workers (imported there by reference)."""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import asyncrpc
import asyncrpc.metrics

_servers: list[asyncrpc.metrics.MetricsServer] = []


def serve_metrics() -> int:
    """Serve this worker's /metrics on a free port (once); the port."""
    if not _servers:
        _servers.append(asyncrpc.metrics.serve(0))
    return _servers[0].port


def stop_metrics() -> None:
    while _servers:
        _servers.pop().close()


def call_peer(peer: str, n: int) -> int:
    """``n`` good calls to ``peer``, one that fails, and one rpc_async; how many succeeded."""
    good = sum(asyncrpc.rpc_sync(peer, operator.add, args=(i, 1)) > i for i in range(n))
    with contextlib.suppress(ZeroDivisionError):
        asyncrpc.rpc_sync(peer, operator.truediv, args=(1, 0))
    good += asyncrpc.rpc_async(peer, operator.add, args=(1, 1)).wait() == 2
    return good


def metrics() -> dict[str, Any]:
    return asyncrpc.get_metrics()
