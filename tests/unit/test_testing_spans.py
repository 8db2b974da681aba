"""The test kit's spans kept in memory (``asyncrpc.testing.spans``): what a traced block
leaves, as plain data (no loop, no worker)."""

from __future__ import annotations

import json
import pickle

import pytest

otel_trace = pytest.importorskip("opentelemetry.trace")
pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.util._once import Once  # noqa: E402

from asyncrpc.testing import spans  # noqa: E402


@pytest.fixture
def fresh_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenTelemetry sets a process's provider once: give this test a process-wide state of
    # its own, put back afterwards, so that no other test sees its provider.
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(spans, "_exporter", None)


@pytest.mark.usefixtures("fresh_provider")
def test_spans_recorded_as_plain_data_with_their_parents() -> None:
    assert spans.recorded_spans() == []  # nothing recorded before record_spans
    spans.record_spans()
    provider = otel_trace.get_tracer_provider()
    spans.record_spans()  # a second call changes nothing
    assert otel_trace.get_tracer_provider() is provider
    tracer = otel_trace.get_tracer("test")
    client = otel_trace.SpanKind.CLIENT
    with (
        tracer.start_as_current_span("root"),
        tracer.start_as_current_span("child", kind=client) as span,
    ):
        span.set_attribute("rpc.system", "asyncrpc")
        span.add_event("rpc.message", {"rpc.message.type": "SENT"})
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR))
    child, root = spans.recorded_spans()  # in the order they ended
    assert (child["name"], root["name"]) == ("child", "root")
    assert root["parent_id"] is None
    assert child["parent_id"] == root["span_id"] != child["span_id"]
    assert child["trace_id"] == root["trace_id"]
    assert (child["kind"], root["kind"]) == ("CLIENT", "INTERNAL")
    assert (child["status"], root["status"]) == ("ERROR", "UNSET")
    assert child["attributes"] == {"rpc.system": "asyncrpc"}
    assert child["events"] == [("rpc.message", {"rpc.message.type": "SENT"})]
    assert root["start"] <= child["start"] <= child["end"] <= root["end"]
    # Plain data: it crosses a pickle (gathered with rpc_sync) and goes into JSON.
    assert pickle.loads(pickle.dumps([child, root])) == [child, root]
    assert json.loads(json.dumps(child))["span_id"] == child["span_id"]
