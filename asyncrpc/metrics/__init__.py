"""Prometheus metrics of a worker (layer L4; needs the optional ``prometheus-client``).

``serve(port)`` exposes ``/metrics`` over HTTP from a thread of its own, through one
collector (``prometheus.py``) that reads, at each scrape, the figures ``get_metrics()``
and ``get_debug_info()`` return; it also starts the per-call figures (calls by kind and
peer, latency histograms) that only a scrape needs. ``collector()`` is that collector,
for a program that serves its own registry. ``serve`` also publishes its endpoint in the
group's rendezvous store, where ``python -m asyncrpc.top --rendezvous`` finds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from asyncrpc.errors import NotInitializedError
from asyncrpc.metrics.snapshot import get_debug_info, publish_endpoint
from asyncrpc.observe.figures import CALL_FIGURES, count_from_start
from asyncrpc.runtime.group import endpoints

__all__ = ["MetricsServer", "collector", "serve"]


def _snapshot() -> Mapping[str, Any] | None:
    try:
        return get_debug_info()
    except NotInitializedError:
        return None  # not started yet, or shut down: an empty scrape


def _count_calls() -> None:
    count_from_start()  # a worker started later counts from its start
    with contextlib.suppress(NotInitializedError):  # the one running counts from now
        CALL_FIGURES.get().start()


def collector() -> Any:
    """The collector of this process's worker, for your own Prometheus registry.

    It reads the worker that runs when it is scraped (none: no samples), and starts the
    per-call figures (``asyncrpc_calls_started_total``, ``asyncrpc_call_latency_seconds``
    ...): of the running worker from now, of a worker started later from its start.

    Returns:
        A ``prometheus_client.registry.Collector``.

    Raises:
        ImportError: ``prometheus-client`` is not installed (``pip install
            asyncrpc-torch[prometheus]``).
    """
    from asyncrpc.metrics.prometheus import WorkerCollector

    _count_calls()
    return WorkerCollector(_snapshot)


class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` (from ``serve``); ``close()`` stops it.

    Attributes:
        host: the address it listens on.
        port: the port it listens on (the one the OS chose for port 0).
    """

    def __init__(self, server: Any, thread: Any, host: str) -> None:
        self._server, self._thread = server, thread
        self.host = host
        self.port: int = server.server_port

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (waits for the server's thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serve this process's worker's metrics at ``http://host:port/metrics``.

    May be called before ``init_rpc``: until a worker runs, scrapes are empty. It starts
    the per-call figures, which cost CPU per call (see ``docs/observability.md``). The
    endpoint is published in the group's rendezvous store (for ``python -m asyncrpc.top
    --rendezvous``): when the worker joins, or now, one store request away, if it runs;
    a wildcard ``host`` is published as the worker's RPC address.

    Args:
        port: the TCP port; 0 lets the OS choose (read ``MetricsServer.port``).
        host: the address to listen on; the default serves this machine only.

    Returns:
        The running ``MetricsServer``.

    Raises:
        ImportError: ``prometheus-client`` is not installed (``pip install
            asyncrpc-torch[prometheus]``).
        OSError: the port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector())
    server, thread = start_http_server(port, addr=host, registry=registry)
    served = MetricsServer(server, thread, host)
    endpoints.announce(host, served.port)  # a worker joining later publishes it
    publish_endpoint(host, served.port)  # or now, if a worker runs
    return served
