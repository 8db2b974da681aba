"""Where a group's workers serve their metrics, kept in the rendezvous store, so that
``python -m asyncrpc.top --rendezvous`` finds them all from the address they joined by
(layer L2.3).

A worker that serves ``/metrics`` (``asyncrpc.metrics.serve``) announces the endpoint
here; it is published when the worker joins a group, or at once if one runs. Each
publication takes a number from one counter and writes one key under it: two store
requests per endpoint, whatever the group's size. A reader takes the counter, then every
key it has not read yet in one ``multi_get``: a refresh that finds nobody new costs one
request. A rank published twice (served again, or a dynamic group's rank taken by a new
member) is read as its latest entry.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EndpointReader",
    "MetricsEndpoint",
    "announce",
    "announced",
    "publish",
    "publish_or_log",
]

_log = logging.getLogger(__name__)
_COUNT = "asyncrpc/metrics_count"
_ENTRY = "asyncrpc/metrics/"
_WILDCARDS = ("", "0.0.0.0", "::")

# The endpoints this process serves: a metrics endpoint is the process's, and is often
# served before init_rpc, so a worker joining later publishes what is here (as the call
# figures' ``count_from_start``: a process-wide fact, added to, never cleared).
_announced: list[tuple[str, int]] = []
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """A worker's published metrics endpoint."""

    rank: int
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


def announce(host: str, port: int) -> None:
    """Record that this process serves metrics at ``host:port`` (any thread)."""
    with _lock:
        _announced.append((host, port))


def announced() -> list[tuple[str, int]]:
    """The endpoints this process announced, oldest first."""
    with _lock:
        return list(_announced)


def publish(store: Any, rank: int, host: str, port: int, rpc_host: str = "") -> None:
    """Publish ``rank``'s endpoint in ``store`` (blocking: two store requests).

    A wildcard ``host`` is not an address to dial: the worker's RPC address stands for it
    (the one its peers reach it by), else this machine's name.

    Raises:
        RuntimeError, OSError: the store cannot be reached (torch's errors).
    """
    if host in _WILDCARDS:
        host = rpc_host if rpc_host not in _WILDCARDS else socket.gethostname()
    number = int(store.add(_COUNT, 1))
    store.set(f"{_ENTRY}{number}", f"{rank} {host} {port}")


def publish_or_log(store: Any, rank: int, host: str, port: int, rpc_host: str = "") -> None:
    """``publish``, best effort: a worker serves and runs the same without it, so a store
    that cannot be reached is logged, not raised."""
    try:
        publish(store, rank, host, port, rpc_host)
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError, DistStoreError
        _log.warning("could not publish metrics endpoint %s:%d in the store: %s", host, port, exc)


def _parse(record: bytes) -> MetricsEndpoint | None:
    try:
        rank, host, port = record.decode().split(" ")
        return MetricsEndpoint(int(rank), host, int(port))
    except ValueError:  # not ours: whoever reaches the store can write to it
        return None


class EndpointReader:
    """Reads the published endpoints of a store, only the new entries on each ``read``."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._read = 0  # entries 1.._read are in _by_rank
        self._by_rank: dict[int, MetricsEndpoint] = {}

    def read(self) -> list[MetricsEndpoint]:
        """Every rank's latest endpoint, by rank (blocking: one request, or three when
        entries were added).

        Raises:
            RuntimeError, OSError: the store cannot be reached (torch's errors).
        """
        count = int(self.store.add(_COUNT, 0))
        keys = [f"{_ENTRY}{n}" for n in range(self._read + 1, count + 1)]
        # multi_get waits for a missing key until the store's timeout: an entry counted
        # but not yet written (its worker is between the two requests) is read next time.
        while keys and not self.store.check(keys):
            keys.pop()
        if keys:
            for record in self.store.multi_get(keys):
                endpoint = _parse(bytes(record))
                if endpoint is not None:
                    self._by_rank[endpoint.rank] = endpoint
            self._read += len(keys)
        return [self._by_rank[rank] for rank in sorted(self._by_rank)]
