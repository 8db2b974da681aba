"""Spans kept in memory, for tests and tools that check or draw a trace (layer L4; needs
``opentelemetry-sdk``): ``record_spans()`` gives this process an SDK tracer provider that
keeps every span it ends, and ``recorded_spans()`` returns them as plain data, which pickles
(a test gathers them from its workers with ``rpc_sync``) and goes into JSON.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record_spans", "recorded_spans"]

# OpenTelemetry sets one tracer provider per process, once: its exporter is one per process
# too, kept here for recorded_spans().
_exporter: Any = None


def record_spans() -> None:
    """Give this process an OpenTelemetry SDK tracer provider that keeps the spans it ends
    in memory, for ``recorded_spans``; a second call changes nothing.

    Call it before anything sets another provider: OpenTelemetry keeps the first one set.

    Raises:
        ImportError: ``opentelemetry-sdk`` is not installed (``pip install
            asyncrpc-torch[otel]``).
    """
    global _exporter
    if _exporter is not None:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)


def recorded_spans() -> list[dict[str, Any]]:
    """The spans this process ended since ``record_spans``, as plain data, in the order
    they ended.

    Returns:
        A dict per span: ``name``, ``kind`` (``"CLIENT"``, ``"SERVER"``, ``"INTERNAL"``...),
        ``trace_id``, ``span_id`` and ``parent_id`` (ints; ``parent_id`` None for a root),
        ``start`` and ``end`` (ns since the epoch), ``status`` (``"UNSET"``, ``"OK"`` or
        ``"ERROR"``), ``attributes`` and ``events`` (``(name, attributes)`` pairs). Empty
        before ``record_spans``.
    """
    if _exporter is None:
        return []
    return [
        {
            "name": s.name, "kind": s.kind.name, "trace_id": s.context.trace_id,
            "span_id": s.context.span_id,
            "parent_id": None if s.parent is None else s.parent.span_id,
            "start": s.start_time, "end": s.end_time, "status": s.status.status_code.name,
            "attributes": dict(s.attributes or {}),
            "events": [(e.name, dict(e.attributes or {})) for e in s.events],
        }
        for s in _exporter.get_finished_spans()
    ]  # fmt: skip
