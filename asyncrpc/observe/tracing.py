"""OpenTelemetry spans for calls, across workers, as a call hook (layer L3).

Imported only where ``opentelemetry-api`` is installed (see ``observe/__init__.py``).
While a tracer provider is set (``opentelemetry.trace.set_tracer_provider``), every
outgoing call (``rpc_sync``, ``rpc_async``, ``remote()``, a stream, a backward hop) is a
CLIENT span, child of the calling thread's current span, ended when the call completes;
its ``traceparent`` rides in the request's header (``traceparent.py``). The callee makes a
SERVER span, child of it, current while the function runs, so what that function calls
is in the same trace (A -> B -> C is one trace). Attributes follow OpenTelemetry's RPC
conventions: ``rpc.system``, ``rpc.method`` (the function's qualified name), peers,
status and ``error.type``, and the sizes of the messages as ``rpc.message`` events: the
client span has the request SENT and the reply RECEIVED, the server span the request
RECEIVED and the reply SENT (each a frame's size on the wire; a reply SENT leaves out its
header, which the hooks are still writing when the span ends). With no provider set the
hook is inactive: one global read per call, no object made, nothing added to the frame.

A generator served as a stream has its span, but what it calls while it iterates is not
under it: the wrapper holds the span current only while the function is called.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
)

from asyncrpc.observe import traceparent
from asyncrpc.runtime.calls.pipeline import CallHook, IncomingCall, OutgoingCall
from asyncrpc.runtime.feature import Feature

__all__ = ["SYSTEM", "TraceHook", "Tracing"]

SYSTEM = "asyncrpc"  # rpc.system: ours, as "grpc" is gRPC's
_SCOPE = "asyncrpc"  # the instrumentation scope's name


class TraceHook(CallHook):
    """Client spans for outgoing calls, server spans for requests that carry a context."""

    fields = frozenset({traceparent.FIELD})
    # OpenTelemetry's spans are thread-safe and nothing here waits: traced calls keep
    # their lanes, on both sides.
    lane_safe = True

    def __init__(self) -> None:
        self._provider: object = None
        self._tracer: Tracer | None = None

    def __repr__(self) -> str:
        return f"TraceHook(tracing={self._tracer is not None})"

    def _current(self) -> Tracer | None:
        # The provider is a module global the API sets once (it refuses to replace it);
        # read it, not get_tracer_provider(), which makes a proxy when none is set. A
        # tracer is made once per provider, not per call.
        provider = otel_trace._TRACER_PROVIDER
        if provider is not self._provider:
            self._provider = provider
            usable = provider is not None and not isinstance(
                provider, otel_trace.NoOpTracerProvider
            )
            self._tracer = provider.get_tracer(_SCOPE) if usable else None  # type: ignore[union-attr]
        return self._tracer

    # -- caller ----------------------------------------------------------------------------

    def active(self) -> bool:
        return self._current() is not None

    def outgoing(self, call: OutgoingCall) -> None:
        tracer = self._tracer
        if tracer is None:  # the provider went away between active() and now
            return
        span = tracer.start_span(
            call.target,
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": SYSTEM, "rpc.method": call.target, "server.address": call.callee,
                "asyncrpc.caller": call.caller, "asyncrpc.callee": call.callee,
                "asyncrpc.kind": call.kind.value,
            },
        )  # fmt: skip
        call.state[self] = span
        context = span.get_span_context()
        if context.is_valid:
            call.headers[traceparent.FIELD] = traceparent.encode(
                context.trace_id, context.span_id, context.trace_flags,
                context.trace_state.to_header(),
            )  # fmt: skip

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        span: Span | None = call.state.pop(self, None)
        if span is None:
            return
        _message(span, "SENT", call.nbytes)  # the request, as framed
        _message(span, "RECEIVED", call.reply_nbytes)  # its reply, if one came
        _end(span, error)

    # -- callee ----------------------------------------------------------------------------

    def incoming(self, call: IncomingCall) -> None:
        tracer = self._current()
        parent = traceparent.decode(call.headers.get(traceparent.FIELD))
        if tracer is None or parent is None:
            return
        remote = SpanContext(
            parent.trace_id, parent.span_id, is_remote=True,
            trace_flags=TraceFlags(parent.flags),
            trace_state=TraceState.from_header([parent.tracestate]) if parent.tracestate
            else None,
        )  # fmt: skip
        span = tracer.start_span(
            call.target,
            context=otel_trace.set_span_in_context(NonRecordingSpan(remote)),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": SYSTEM, "rpc.method": call.target, "client.address": call.caller,
                "asyncrpc.caller": call.caller, "asyncrpc.callee": call.callee,
                "asyncrpc.kind": "remote" if call.remote else "call",
            },
        )  # fmt: skip
        call.state[self] = span
        _message(span, "RECEIVED", call.nbytes)
        call.wrap(functools.partial(_current_while_running, span, call.coroutine))

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        span: Span | None = call.state.pop(self, None)
        if span is not None:
            _message(span, "SENT", call.reply_nbytes)
            _end(span, None if ok else value)


def _message(span: Span, direction: str, nbytes: int) -> None:
    """OpenTelemetry's RPC message event: one message each way per call, so each is the
    first (id 1) of its direction; a size of 0 means none went, and makes no event."""
    if nbytes:
        event: dict[str, str | int] = {"rpc.message.type": direction, "rpc.message.id": 1,
                 "rpc.message.uncompressed_size": nbytes}  # fmt: skip
        span.add_event("rpc.message", event)


def _end(span: Span, error: object) -> None:
    if isinstance(error, BaseException):
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end()


def _current_while_running(
    span: Span, coroutine: bool, fn: Callable[..., Any]
) -> Callable[..., Any]:
    """``fn``, run with ``span`` current, so the calls it makes are its children."""
    if coroutine:

        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            with otel_trace.use_span(span, end_on_exit=False, record_exception=False,
                                     set_status_on_exception=False):  # fmt: skip
                return await fn(*args, **kwargs)

        return traced_async

    def traced(*args: Any, **kwargs: Any) -> Any:
        with otel_trace.use_span(span, end_on_exit=False, record_exception=False,
                                 set_status_on_exception=False):  # fmt: skip
            return fn(*args, **kwargs)

    return traced


class Tracing(Feature):
    """OpenTelemetry tracing on one worker: its hook (inactive until a provider is set)."""

    name = "tracing"

    def __init__(self) -> None:
        self.hook = TraceHook()

    def hooks(self) -> Sequence[CallHook]:
        return (self.hook,)
