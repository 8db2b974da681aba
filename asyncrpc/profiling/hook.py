"""The profiling hook of the call pipeline (layer L3).

Caller: while a torch profiler runs on the calling thread (``torch.profiler.profile``,
``torch.autograd.profiler.profile`` or the legacy ``torch.autograd.profiler_legacy.profile``),
each outgoing call opens a ``record_function`` span named like torch's
(``rpc_sync#fn(caller -> callee)``) on the calling thread, closes it when the call
completes, before its future does, and asks the callee (header field ``p``, a bit set of
``recorder.ASKED``/``SHAPES``/``MEMORY``) to record what it runs. Callee: a request that
asks, or any request while the server profiler is on, runs recorded (see ``recorder.py``);
the recording goes back in the reply's ``p`` field and/or into the server profiler's list.
A call made by a function being recorded is recorded into that recording instead, with
what its own callee sent back, so the first caller sees the whole chain. Off, the hook
adds nothing to a frame and costs two flag tests per call.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.autograd import profiler as torch_profiler

from asyncrpc.profiling.merge import RemoteBatch, deliver, install, requested_flags, set_node_id
from asyncrpc.profiling.names import (
    call_name,
    is_torch_op,
    remote_event_name,
    rpc_span_name,
    stream_items_name,
)
from asyncrpc.profiling.recorder import (
    ASKED,
    Recording,
    centred_offset,
    current_recording,
    recorded,
    relabel,
)
from asyncrpc.runtime.calls.pending import describe_function
from asyncrpc.runtime.calls.pipeline import CallHook, CallKind, IncomingCall, OutgoingCall

__all__ = ["FIELD", "ProfilingHook"]

FIELD = "p"  # the header field this hook owns

_enter = torch.ops.profiler._record_function_enter_new
# Ends a span when a torch future completes, on whichever thread completes it, with the
# profiler state of the thread that registered it: the legacy profiler is per thread, and
# our calls complete on the agent's loop thread.
_end_on = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction
_enabled_here = torch._C._autograd._profiler_enabled  # any profiler, on this thread


class _Nested:
    """An RPC made by a function being recorded: it goes into that recording."""

    __slots__ = ("name", "recording", "start_ns")

    def __init__(self, name: str, recording: Recording) -> None:
        self.name, self.recording = name, recording
        self.start_ns = time.perf_counter_ns()


class ProfilingHook(CallHook):
    """RPC spans for the caller's profiler; recordings from the callee."""

    fields = frozenset({FIELD})

    def __init__(self, rank: int) -> None:
        self._rank = rank  # this worker's rank: the node_id of its events
        self._lock = threading.Lock()
        # The server profiler: None when off, else the recordings of the requests served.
        self._served: list[tuple[int, str, str, list[list[Any]]]] | None = None
        install()

    def __repr__(self) -> str:
        return "ProfilingHook()"

    # -- caller ----------------------------------------------------------------------------

    def active(self) -> bool:
        # The module flag is torch's own cheap test for its kineto profilers; the legacy
        # profiler sets no flag, so ask torch whether one runs on this thread.
        return torch_profiler._is_profiler_enabled or _enabled_here()

    def outgoing(self, call: OutgoingCall) -> None:
        function = call_name(call.target, describe_function(call.fn), call.fn)
        name = rpc_span_name(call.kind, function, call.caller, call.callee)
        recording = current_recording()
        if recording is not None:
            call.state[self] = _Nested(name, recording)
            call.headers[FIELD] = recording.flags
            return
        set_node_id(self._rank)
        done: torch.futures.Future[None] = torch.futures.Future()
        _end_on(_enter(name, None), done)
        call.state[self] = (name, done)
        call.headers[FIELD] = requested_flags()

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        started = call.state.pop(self, None)
        if started is None:
            return
        rows = None if headers is None else headers.get(FIELD)
        rows = rows if isinstance(rows, list) and rows else None
        if call.kind is CallKind.STREAM and error is None and isinstance(call.result, int):
            # One span per stream; its value is the item count, shown as an event in it.
            rows = [[stream_items_name(call.result), 0.0, 0.0, 0, -1, None, 0], *(rows or [])]
        if isinstance(started, _Nested):
            _add_nested(started, call.callee_rank, rows)
            return
        name, done = started
        done.set_result(None)  # ends the span here, before the call's future completes
        if rows is not None:
            deliver(RemoteBatch(name, call.callee_rank, rows))

    # -- callee ----------------------------------------------------------------------------

    def serves_all(self) -> bool:
        return self._served is not None

    def incoming(self, call: IncomingCall) -> None:
        asked = call.headers.get(FIELD)
        if asked is None and self._served is None:
            return
        recording = Recording(call.target, asked if isinstance(asked, int) else ASKED)
        # A torch op (rpc_sync(to, torch.add, ...)) is recorded as that op's own event, as
        # torch's callee records it; a function of ours would only repeat it.
        call.state[self] = (recording, is_torch_op(call.fn))
        call.wrap(lambda fn: recorded(fn, recording, call.coroutine))

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        state = call.state.pop(self, None)
        if state is None:
            return
        recording, op = state
        rows = recording.as_rows()
        if FIELD in call.headers:
            call.reply_headers[FIELD] = rows[1:] if op else rows
        with self._lock:
            if self._served is not None:
                self._served.append((recording.start_ns, call.caller, call.target, rows))

    # -- the server profiler ---------------------------------------------------------------

    def start_serving(self) -> None:
        with self._lock:
            if self._served is None:
                self._served = []

    def stop_serving(self) -> list[tuple[int, str, str, list[list[Any]]]]:
        with self._lock:
            served, self._served = self._served or [], None
        return served


def _add_nested(nested: _Nested, callee_rank: int, rows: list[list[Any]] | None) -> None:
    """Add an RPC's span, and what its callee recorded, to the recording that made it."""
    recording = nested.recording
    start_us = recording.offset_us(nested.start_ns)
    end_us = recording.offset_us(time.perf_counter_ns())
    added = [[nested.name, start_us, end_us, recording.thread, -1, None, 0]]
    if rows is not None:
        offset_us = centred_offset(start_us, end_us, rows)
        name = nested.name
        added += relabel(rows, lambda event: remote_event_name(name, event), offset_us, callee_rank)
    recording.add(added)
