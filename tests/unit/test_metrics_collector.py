"""The Prometheus collector's families from a ``get_debug_info()`` snapshot (no worker)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncrpc.metrics.prometheus import WorkerCollector, families
from asyncrpc.observe.figures import LATENCY_BUCKETS

SNAPSHOT = {
    "name": "w1", "rank": 1, "world_size": 4, "calls_sent": 7, "pending_calls": 2,
    "loop_lag_ms": 1.5, "leaving": False, "lost_peers": ["w3"],
    "pending_by_peer": {"w2": 2}, "device_maps": {}, "handoffs_thread_to_loop": 3,
    "call_latency_buckets": list(LATENCY_BUCKETS),
    "call_figures": [{
        "kind": "sync", "peer": "w2", "started": 3, "finished": 2, "failed": 1,
        "latency_buckets": [0, 1] + [0] * (len(LATENCY_BUCKETS) - 2) + [1],
        "latency_sum_s": 60.0001,
    }],
}  # fmt: skip


def parsed(snapshot: dict) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def test_collector_types_and_labels() -> None:
    found = parsed(SNAPSHOT)
    assert found["asyncrpc_calls_sent"][0] == "counter"
    assert found["asyncrpc_pending_calls"][0] == "gauge"
    assert found["asyncrpc_handoffs_thread_to_loop"][0] == "counter"
    assert found["asyncrpc_leaving"][1][0].value == 0
    assert found["asyncrpc_loop_lag_ms"][1][0].labels == {"worker": "w1"}
    assert found["asyncrpc_peers_lost"][1][0].value == 1
    assert found["asyncrpc_peer_lost"][1][0].labels == {"worker": "w1", "peer": "w3"}
    assert found["asyncrpc_pending_calls_by_peer"][1][0].value == 2
    assert "asyncrpc_device_maps" not in found


def test_collector_latency_histogram_is_cumulative() -> None:
    kind, samples = parsed(SNAPSHOT)["asyncrpc_call_latency_seconds"]
    assert kind == "histogram"
    buckets = [s for s in samples if s.name.endswith("_bucket")]
    assert len(buckets) == len(LATENCY_BUCKETS) + 1
    assert [s.value for s in buckets][:3] == [0, 1, 1]
    assert buckets[-1].labels["le"] == "+Inf"
    assert buckets[-1].value == 2
    count = next(s for s in samples if s.name.endswith("_count"))
    assert count.value == 2


def test_collector_without_figures_or_worker() -> None:
    assert not any("latency" in f.name for f in families({"name": "w", "calls_sent": 1}))
    assert parsed(None) == {}  # type: ignore[arg-type]
