"""One worker's figures from one scrape, and what two scrapes say about it (layer L4).

Pure functions over parsed samples: the rates (calls/s, bytes/s, stream items/s) are
differences of counters between the oldest and newest scrape of a window, and p50/p99
come from the latency histogram's buckets the same way Prometheus' ``histogram_quantile``
reads them (linear within a bucket), over the calls that ended in the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from asyncrpc.top.exposition import Sample

__all__ = ["Figures", "extract", "quantile", "rate"]

PREFIX = "asyncrpc_"
_LATENCY = f"{PREFIX}call_latency_seconds_bucket"


@dataclass(frozen=True, slots=True)
class Figures:
    """What one scrape of a worker's ``/metrics`` says.

    Attributes:
        worker: its name ("" when no worker ran in the process yet).
        rank: its rank, as text.
        world_size: its group's size, as text.
        values: every sample labelled only ``worker``, by name without ``asyncrpc_``
            (counters keep their ``_total``).
        lost: the peers it lost for good.
        latency: the cumulative latency buckets of all its calls (every kind and callee
            summed), by upper bound in seconds (``inf`` last).
    """

    worker: str = ""
    rank: str = ""
    world_size: str = ""
    values: Mapping[str, float] = field(default_factory=dict)
    lost: tuple[str, ...] = ()
    latency: Mapping[float, float] = field(default_factory=dict)

    def get(self, key: str) -> float | None:
        return self.values.get(key)


def extract(samples: Iterable[Sample]) -> Figures:
    """The figures of one scrape of a worker's endpoint.

    Args:
        samples: the parsed scrape.

    Returns:
        Its ``Figures``; an endpoint served before ``init_rpc`` gives empty ones.
    """
    worker = rank = world = ""
    values: dict[str, float] = {}
    lost: list[str] = []
    latency: dict[float, float] = {}
    for sample in samples:
        if not sample.name.startswith(PREFIX):
            continue
        key, labels = sample.name[len(PREFIX) :], sample.labels
        if key == "worker_info":
            worker, rank, world = (
                labels.get("worker", ""),
                labels.get("rank", ""),
                labels.get("world_size", ""),
            )
        elif key == "peer_lost" and sample.value:
            lost.append(labels.get("peer", "?"))
        elif sample.name == _LATENCY:
            bound = float(labels.get("le", "inf"))
            latency[bound] = latency.get(bound, 0.0) + sample.value
        elif set(labels) <= {"worker"}:
            values[key] = sample.value
    ordered = dict(sorted(latency.items()))
    return Figures(worker, rank, world, values, tuple(sorted(lost)), ordered)


def rate(old: Figures, new: Figures, key: str, seconds: float) -> float | None:
    """How fast counter ``key`` grew between two scrapes ``seconds`` apart, per second.

    None when either scrape lacks it, no time passed, or it went down (the worker
    restarted: its counters began again).
    """
    before, after = old.get(key), new.get(key)
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def quantile(
    q: float, buckets: Mapping[float, float], since: Mapping[float, float]
) -> float | None:
    """The ``q`` quantile (0..1) of the calls counted in ``buckets`` but not in ``since``.

    Both are cumulative histograms by upper bound (``since`` may be empty: all calls).
    As Prometheus' ``histogram_quantile``: found by linear interpolation within the
    bucket the rank falls in; in the ``+Inf`` bucket, the highest finite bound.

    Returns:
        Seconds, or None when no call ended in between.
    """
    counts = [(bound, n - since.get(bound, 0.0)) for bound, n in sorted(buckets.items())]
    if not counts or counts[-1][1] <= 0:
        return None
    total = counts[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank and cumulative > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        if bound != float("inf"):
            lower = bound
        below = cumulative
    return lower
