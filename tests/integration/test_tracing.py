"""OpenTelemetry spans across three worker processes (``trace_job.py``), exported into
memory by the SDK on each worker and gathered by t0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from tests.integration.observe_jobs import run_group

pytestmark = pytest.mark.timeout(180)
FNS = "tests.integration.trace_fns"


def gathered(outputs: list[str]) -> dict[str, Any]:
    line = next(line for line in outputs[0].splitlines() if line.startswith("SPANS "))
    result: dict[str, Any] = json.loads(line[len("SPANS ") :])
    return result


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return gathered(run_group("tests.integration.trace_job", 3, [], tmp_path_factory.mktemp("t")))


def in_trace(traced: dict[str, Any], root: str) -> list[dict[str, Any]]:
    trace_id = traced["roots"][root]
    return [s for s in traced["spans"] if s["trace_id"] == trace_id]


def one(spans: list[dict[str, Any]], kind: str, name: str, caller: str | None = None) -> dict:
    found = [
        s for s in spans
        if s["kind"] == kind and s["name"] == name
        and (caller is None or s["attributes"].get("asyncrpc.caller") == caller)
    ]  # fmt: skip
    assert len(found) == 1, (kind, name, caller, spans)
    return found[0]


@pytest.mark.parametrize(("root", "hop"), [("chain", "hop"), ("async_chain", "async_hop")])
def test_tracing_chain_is_one_trace_with_parents(traced: dict, root: str, hop: str) -> None:
    spans = in_trace(traced, root)
    user = one(spans, "INTERNAL", root)
    client_ab = one(spans, "CLIENT", f"{FNS}.{hop}")
    server_b = one(spans, "SERVER", f"{FNS}.{hop}")
    client_bc = one(spans, "CLIENT", f"{FNS}.leaf")
    server_c = one(spans, "SERVER", f"{FNS}.leaf")
    assert client_ab["parent_id"] == user["span_id"]
    assert server_b["parent_id"] == client_ab["span_id"]
    assert client_bc["parent_id"] == server_b["span_id"]
    assert server_c["parent_id"] == client_bc["span_id"]
    assert len(spans) == 5
    attrs = client_ab["attributes"]
    assert attrs["rpc.system"] == "asyncrpc"
    assert attrs["rpc.method"] == f"{FNS}.{hop}"
    assert (attrs["asyncrpc.caller"], attrs["asyncrpc.callee"]) == ("t0", "t1")
    assert attrs["asyncrpc.kind"] == ("sync" if root == "chain" else "async")
    assert client_bc["attributes"]["asyncrpc.callee"] == "t2"
    assert server_c["attributes"]["client.address"] == "t1"
    name, sent = client_ab["events"][0]
    assert name == "rpc.message"
    assert sent["rpc.message.type"] == "SENT"
    assert sent["rpc.message.uncompressed_size"] > 0


@pytest.mark.parametrize(
    ("root", "name", "kind"),
    [("remote", "leaf", "remote"), ("stream", "count", "stream"), ("error", "fail", "sync")],
)
def test_tracing_kinds_have_client_and_server_spans(
    traced: dict, root: str, name: str, kind: str
) -> None:
    spans = in_trace(traced, root)
    client = one(spans, "CLIENT", f"{FNS}.{name}")
    server = one(spans, "SERVER", f"{FNS}.{name}")
    assert client["attributes"]["asyncrpc.kind"] == kind
    assert server["parent_id"] == client["span_id"]
    if root == "error":
        assert client["status"] == server["status"] == "ERROR"
        assert (
            client["attributes"]["error.type"] == server["attributes"]["error.type"] == "KeyError"
        )
    else:
        assert client["status"] == server["status"] == "UNSET"
    if root != "stream":  # a reply (an error, a remote()'s acknowledgement) has its size
        assert 0 < sizes(server)["SENT"] <= sizes(client)["RECEIVED"]


def test_tracing_distributed_backward_hops_are_spans(traced: dict) -> None:
    spans = in_trace(traced, "backward")
    user = one(spans, "INTERNAL", "backward")
    hop = one(spans, "CLIENT", "asyncrpc.autograd.engine.grads_here")
    assert hop["parent_id"] == user["span_id"]
    assert (
        one(spans, "SERVER", "asyncrpc.autograd.engine.grads_here")["parent_id"] == hop["span_id"]
    )


def sizes(span: dict[str, Any]) -> dict[str, int]:
    """A span's ``rpc.message`` events: the size of each direction's message."""
    found = {}
    for name, attributes in span["events"]:
        if name == "rpc.message":
            assert attributes["rpc.message.id"] == 1
            direction = attributes["rpc.message.type"]
            assert direction not in found, span
            found[direction] = attributes["rpc.message.uncompressed_size"]
    return found


@pytest.mark.parametrize(
    ("root", "name", "tensor"),
    [("sizes_sync", "size_of", 1 << 19), ("sizes_async", "async_size_of", 1 << 20)],
)
def test_tracing_spans_have_the_message_sizes_both_ways(
    traced: dict, root: str, name: str, tensor: int
) -> None:
    if root == "sizes_sync":  # the lanes' path, on both sides
        assert traced["on_lane"] == 1
    spans = in_trace(traced, root)
    client = sizes(one(spans, "CLIENT", f"{FNS}.{name}"))
    server = sizes(one(spans, "SERVER", f"{FNS}.{name}"))
    # The request carries the tensor: the same frame, as sent and as received.
    assert tensor <= client["SENT"] == server["RECEIVED"] < tensor + 4096
    # The reply is a small int: its frame, and the server's view of it less its header.
    assert 0 < server["SENT"] <= client["RECEIVED"] < 512


def test_tracing_without_a_provider_makes_no_span(tmp_path: Path) -> None:
    outputs = run_group("tests.integration.trace_job", 3, ["--no-provider"], tmp_path)
    result = gathered(outputs)
    assert result["spans"] == []
    assert set(result["roots"].values()) == {0}  # the API's no-op spans: no trace
