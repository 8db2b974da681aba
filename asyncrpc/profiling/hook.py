"""The profiling hook of the call pipeline (layer L3).

Caller: while a torch profiler runs in this process, each outgoing call opens a
``record_function`` span named like torch's (``rpc_sync#module.fn(caller -> callee)``) on
the calling thread and closes it when the call completes, and asks the callee (header
field ``p``) to record what it runs. Callee: a request that asks, or any request while
the server profiler is on, runs recorded (see ``recorder.py``); the recording goes back in
the reply's ``p`` field and/or into the server profiler's list. Off, the hook adds nothing
to a frame and costs one flag test per call.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.autograd import profiler as torch_profiler

from asyncrpc.profiling.merge import RemoteBatch, deliver
from asyncrpc.profiling.names import rpc_span_name
from asyncrpc.profiling.recorder import Recording, recorded
from asyncrpc.runtime.pipeline import CallHook, IncomingCall, OutgoingCall

__all__ = ["FIELD", "ProfilingHook"]

FIELD = "p"  # the header field this hook owns

_enter = torch.ops.profiler._record_function_enter_new
_exit = torch.ops.profiler._record_function_exit._RecordFunction


class ProfilingHook(CallHook):
    """RPC spans for the caller's profiler; recordings from the callee."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The server profiler: None when off, else the recordings of the requests served.
        self._served: list[tuple[int, str, str, list[list[Any]]]] | None = None

    def __repr__(self) -> str:
        return "ProfilingHook()"

    # -- caller ----------------------------------------------------------------------------

    def active(self) -> bool:
        return torch_profiler._is_profiler_enabled

    def outgoing(self, call: OutgoingCall) -> None:
        name = rpc_span_name(call.kind, call.target, call.caller, call.callee)
        call.state[self] = (name, _enter(name, None))
        call.headers[FIELD] = 1

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        started = call.state.pop(self, None)
        if started is None:
            return
        name, handle = started
        # Closed on the loop thread: torch's span ends where the RPC's future completes.
        _exit(handle)
        rows = None if headers is None else headers.get(FIELD)
        if isinstance(rows, list) and rows:
            deliver(RemoteBatch(name, call.callee_rank, rows))

    # -- callee ----------------------------------------------------------------------------

    def serves_all(self) -> bool:
        return self._served is not None

    def incoming(self, call: IncomingCall) -> None:
        if FIELD not in call.headers and self._served is None:
            return
        recording = Recording(call.target)
        call.state[self] = recording
        call.wrap(lambda fn: recorded(fn, recording, call.coroutine))

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        recording = call.state.pop(self, None)
        if not isinstance(recording, Recording):
            return
        rows = recording.as_rows()
        if FIELD in call.headers:
            call.reply_headers[FIELD] = rows
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
