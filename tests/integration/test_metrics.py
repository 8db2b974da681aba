"""``asyncrpc.metrics``: a live worker's /metrics, scraped over HTTP and parsed with
prometheus_client's own parser (w1 of the session group serves it)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

import asyncrpc

parser = pytest.importorskip("prometheus_client.parser")

from tests.integration import observe_fns as fns  # noqa: E402
from tests.integration.conftest import Group  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """The families of one scrape: name -> (sample name, labels, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in parser.text_string_to_metric_families(text)
    }


def value(families: dict, name: str, **labels: str) -> float:
    family = families[name.removesuffix("_total")]  # a counter's family drops "_total"
    found = [v for sample, got, v in family if got == {**got, **labels} and sample == name]
    assert len(found) == 1, (name, labels, families.get(name))
    return found[0]


@pytest.fixture
def port(group: Group) -> Iterator[int]:
    port = asyncrpc.rpc_sync("w1", fns.serve_metrics)
    try:
        yield port
    finally:
        asyncrpc.rpc_sync("w1", fns.stop_metrics)


def test_metrics_scrape_reads_get_metrics(port: int) -> None:
    families = scrape(port)
    figures = asyncrpc.rpc_sync("w1", fns.metrics)
    # Every figure of get_metrics() is a family of the scrape; counters as _total.
    for key in figures:
        assert f"asyncrpc_{key}" in families, key
    assert families["asyncrpc_worker_info"][0][1]["worker"] == "w1"
    assert value(families, "asyncrpc_thread_pool_size", worker="w1") == figures["thread_pool_size"]
    # The counters only grow between two scrapes with calls in between.
    received = value(families, "asyncrpc_calls_received_total", worker="w1")
    for _ in range(3):
        asyncrpc.rpc_sync("w1", fns.metrics)
    later = scrape(port)
    assert value(later, "asyncrpc_calls_received_total", worker="w1") >= received + 3


def test_metrics_scrape_counts_calls_by_kind_and_peer(port: int) -> None:
    before = scrape(port)
    assert asyncrpc.rpc_sync("w1", fns.call_peer, args=("w3", 4)) == 5
    after = scrape(port)

    def grew(name: str, kind: str) -> float:
        labels = {"worker": "w1", "kind": kind, "peer": "w3"}
        family = before.get(name.removesuffix("_total"), [])
        with_old = [v for s, got, v in family if s == name and got == {**got, **labels}]
        old = with_old[0] if with_old else 0.0
        return value(after, name, **labels) - old

    assert grew("asyncrpc_calls_started_total", "sync") == 5
    assert grew("asyncrpc_calls_finished_total", "sync") == 5
    assert grew("asyncrpc_calls_errored_total", "sync") == 1
    assert grew("asyncrpc_calls_started_total", "async") == 1
    # The latency histogram counts each ended call once, in cumulative buckets.
    buckets = [
        (labels["le"], v)
        for sample, labels, v in after["asyncrpc_call_latency_seconds"]
        if sample.endswith("_bucket") and labels["kind"] == "sync" and labels["peer"] == "w3"
    ]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert buckets[-1][0] == "+Inf"
    assert buckets[-1][1] == value(
        after, "asyncrpc_calls_finished_total", worker="w1", kind="sync", peer="w3"
    )
