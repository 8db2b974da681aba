"""The tracing hook is inactive until a real tracer provider is set (no loop, no worker)."""

from __future__ import annotations

import pytest

otel_trace = pytest.importorskip("opentelemetry.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from asyncrpc.observe.tracing import TraceHook  # noqa: E402
from asyncrpc.runtime.calls.pipeline import CallKind, OutgoingCall  # noqa: E402


def test_trace_hook_active_only_with_a_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = TraceHook()
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", None)
    assert not hook.active()
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", otel_trace.NoOpTracerProvider())
    assert not hook.active()
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", TracerProvider())
    assert hook.active()
    call = OutgoingCall(CallKind.SYNC, "a", "b", 1, len, "builtins.len", (), {})
    hook.outgoing(call)
    assert call.headers["tc"].startswith("00-")  # the W3C traceparent, version 00
    hook.completed(call, None, KeyError("x"))
    assert hook not in call.state
