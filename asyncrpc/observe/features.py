"""The observing features a new worker gets (layer L3): its call figures, and tracing
where ``opentelemetry-api`` imports (else the tracing module is never imported).
"""

from __future__ import annotations

from asyncrpc.observe.figures import CallFigures
from asyncrpc.runtime.feature import Feature

__all__ = ["features", "tracing_available"]


def tracing_available() -> bool:
    """Whether ``opentelemetry-api`` can be imported in this process."""
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


def features() -> list[Feature]:
    """The observing features of a new worker: its call figures, and tracing if available."""
    made: list[Feature] = [CallFigures()]
    if tracing_available():
        from asyncrpc.observe.tracing import Tracing

        made.append(Tracing())
    return made
