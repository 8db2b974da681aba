"""Seeing a running group from outside its processes (layer L3): call figures by kind and
peer for Prometheus (``figures.py``, read by ``asyncrpc.metrics``), and OpenTelemetry spans
that cross workers (``tracing.py``, W3C trace context in ``traceparent.py``).

Both are optional: tracing is built only where ``opentelemetry-api`` imports, and the
figures count only once ``asyncrpc.metrics.serve`` asks for them.
"""

from __future__ import annotations

from asyncrpc.observe.figures import CALL_FIGURES, CallFigures, FiguresHook

__all__ = ["CALL_FIGURES", "CallFigures", "FiguresHook"]
