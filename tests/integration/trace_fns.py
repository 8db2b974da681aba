"""What the tracing test's workers run: an in-memory span exporter, and the functions a
traced chain calls (imported by reference on every worker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import asyncrpc

_exporter: Any = None


def install() -> None:
    """Set this process's tracer provider, exporting into memory."""
    global _exporter
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)


def finished_spans() -> list[dict[str, Any]]:
    """The spans this process ended, as plain data."""
    if _exporter is None:
        return []
    return [
        {
            "name": s.name, "kind": s.kind.name, "trace_id": s.context.trace_id,
            "span_id": s.context.span_id,
            "parent_id": None if s.parent is None else s.parent.span_id,
            "attributes": dict(s.attributes or {}), "status": s.status.status_code.name,
            "events": [(e.name, dict(e.attributes or {})) for e in s.events],
        }
        for s in _exporter.get_finished_spans()
    ]  # fmt: skip


def leaf(x: int) -> int:
    return x + 1


def hop(peer: str, x: int) -> int:
    """Calls ``peer`` from inside a served call: its span is this call's child."""
    return asyncrpc.rpc_sync(peer, leaf, args=(x,)) * 10


async def async_hop(peer: str, x: int) -> int:
    return (await asyncrpc.rpc_async(peer, leaf, args=(x,))) * 10


def fail() -> None:
    raise KeyError("traced")


def count(n: int) -> Iterator[int]:
    yield from range(n)


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def size_of(x: torch.Tensor) -> int:
    """A small reply to a large request: the message sizes differ by far."""
    return x.numel() * x.element_size()


async def async_size_of(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()
