"""The one Prometheus collector of a worker: ``get_debug_info()`` as metric families
(layer L4).

It keeps no counter of its own: each scrape reads the agent's figures once (the same
``get_metrics()`` numbers, plus the RRef, autograd and per-call figures that
``get_debug_info()`` adds) and turns them into families named ``asyncrpc_<key>``,
labelled with the worker's name. Which figures are counters (``_total``) is said here;
every other number is a gauge.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from asyncrpc.runtime.metrics import Counters

__all__ = ["COUNTERS", "PREFIX", "WorkerCollector", "families"]

_log = logging.getLogger(__name__)

PREFIX = "asyncrpc"
# The figures that only grow (until the worker restarts); the rest are gauges.
COUNTERS: frozenset[str] = frozenset(
    {field.name for field in dataclasses.fields(Counters)}
    | {
        "bytes_in",
        "bytes_out",
        "shm_segments_sent",
        "shm_bytes_sent",
        "shm_segments_received",
        "shm_fallbacks",
        "thread_pool_refused",
        "stream_items_sent",
        "stream_items_received",
        "lanes_opened",
        "lanes_idle_closed",
        "lane_calls",
        "lanes_served",
        "lane_requests_served",
        "lane_polls",
        "lane_poll_hits",
        "forks_undelivered",
        "forks_queried",
    }
)
_COUNTER_PREFIXES = ("handoffs_", "autograd_")
# Keys read below as labelled families, or not numbers to export.
_SPECIAL = frozenset({
    "name", "rank", "world_size", "pending_by_peer", "lost_peers", "device_maps",
    "call_figures", "call_latency_buckets",
})  # fmt: skip


def _is_counter(key: str) -> bool:
    return key in COUNTERS or key.startswith(_COUNTER_PREFIXES)


def families(info: Mapping[str, Any]) -> list[Any]:
    """The metric families of one worker's ``get_debug_info()`` snapshot.

    Args:
        info: the snapshot (``Agent.debug_info()``).

    Returns:
        Prometheus metric families, every sample labelled ``worker``.
    """
    worker = str(info.get("name", ""))
    made: list[Any] = []
    identity = InfoMetricFamily(f"{PREFIX}_worker", "This worker's name, rank and group size")
    identity.add_metric([], {
        "worker": worker, "rank": str(info.get("rank", "")),
        "world_size": str(info.get("world_size", "")),
    })  # fmt: skip
    made.append(identity)
    for key, value in info.items():
        if key in _SPECIAL or not isinstance(value, int | float):
            continue
        family: Any
        if _is_counter(key) and not isinstance(value, bool):
            family = CounterMetricFamily(f"{PREFIX}_{key}", f"get_metrics()['{key}']",
                                         labels=["worker"])  # fmt: skip
        else:
            family = GaugeMetricFamily(f"{PREFIX}_{key}", f"get_metrics()['{key}']",
                                       labels=["worker"])  # fmt: skip
        family.add_metric([worker], float(value))
        made.append(family)
    made += _peer_families(worker, info)
    made += _call_families(worker, info)
    return made


def _peer_families(worker: str, info: Mapping[str, Any]) -> list[Any]:
    lost = [str(name) for name in info.get("lost_peers", ())]
    count = GaugeMetricFamily(
        f"{PREFIX}_peers_lost", "Peers this worker lost for good", labels=["worker"]
    )
    count.add_metric([worker], len(lost))
    each = GaugeMetricFamily(
        f"{PREFIX}_peer_lost", "1 for each peer lost for good", labels=["worker", "peer"]
    )
    for name in lost:
        each.add_metric([worker, name], 1)
    pending = GaugeMetricFamily(
        f"{PREFIX}_pending_calls_by_peer", "Calls waiting for a reply, by callee",
        labels=["worker", "peer"],
    )  # fmt: skip
    for name, n in dict(info.get("pending_by_peer", {})).items():
        pending.add_metric([worker, str(name)], n)
    return [count, each, pending]


def _call_families(worker: str, info: Mapping[str, Any]) -> list[Any]:
    rows = info.get("call_figures")
    bounds = info.get("call_latency_buckets")
    if not rows or not bounds:
        return []  # not counting (asyncrpc.metrics.serve turns it on)
    labels = ["worker", "kind", "peer"]
    started = CounterMetricFamily(f"{PREFIX}_calls_started", "Calls made", labels=labels)
    finished = CounterMetricFamily(f"{PREFIX}_calls_finished", "Calls ended", labels=labels)
    # Not "calls_failed": that is get_metrics()'s figure for the whole worker.
    failed = CounterMetricFamily(
        f"{PREFIX}_calls_errored", "Calls ended with an error", labels=labels
    )
    latency = HistogramMetricFamily(
        f"{PREFIX}_call_latency_seconds", "From the call to its end, on the caller",
        labels=labels,
    )  # fmt: skip
    for row in rows:
        values = [worker, str(row["kind"]), str(row["peer"])]
        started.add_metric(values, row["started"])
        finished.add_metric(values, row["finished"])
        failed.add_metric(values, row["failed"])
        cumulative, buckets = 0, []
        for bound, count in zip([*map(float, bounds), float("inf")], row["latency_buckets"],
                                strict=True):  # fmt: skip
            cumulative += count
            buckets.append((_le(bound), cumulative))
        latency.add_metric(values, buckets, row["latency_sum_s"])
    return [started, finished, failed, latency]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class WorkerCollector(Collector):
    """Reads a worker's figures at each scrape.

    Args:
        snapshot: returns the figures (``Agent.debug_info``), or None when no worker runs.
    """

    def __init__(self, snapshot: Callable[[], Mapping[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Any]:
        return ()  # families depend on the worker: no check at registration

    def collect(self) -> Iterator[Any]:
        info = None
        # The figures are read on this (the HTTP server's) thread while the loop changes
        # them; a dict that changed size mid-read is read again.
        for _ in range(3):
            try:
                info = self._snapshot()
                break
            except RuntimeError:
                continue
        if info is None:
            return
        yield from families(info)
