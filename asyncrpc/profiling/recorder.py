"""Records what a request runs on the callee: the function's span and the torch ops inside
it, on the thread that runs it (layer L3).

torch's kineto profiler is one per process, so the callee records with the legacy profiler,
which is per thread (torch's own RPC agent does the same on its server threads). A
synchronous function is recorded in one session; an ``async def`` function in one session
per step of its coroutine, so ops of other requests interleaved on the loop are not counted.
An ``@async_execution`` function is recorded until it returns its future.

A recording is a list of ``[name, start_us, end_us, thread]`` rows, msgpack-able, with
times relative to the start of the function; its first row is the function itself.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from torch.autograd.profiler_legacy import profile as legacy_profile

__all__ = ["MAX_EVENTS", "Recording", "recorded"]

# A reply carries at most this many events (a loop of small ops can make millions).
MAX_EVENTS = 5000

Row = list[Any]


class Recording:
    """The events of one request, filled while it runs."""

    __slots__ = ("dropped", "end_ns", "rows", "start_ns", "target", "thread")

    def __init__(self, target: str) -> None:
        self.target = target
        self.start_ns = 0
        self.end_ns = 0
        self.thread = 0
        self.rows: list[Row] = []
        self.dropped = 0

    def begin(self) -> None:
        self.start_ns = time.perf_counter_ns()
        self.thread = threading.get_ident()

    def finish(self) -> None:
        self.end_ns = time.perf_counter_ns()

    def add_session(self, session_start_ns: int, events: Any) -> None:
        offset_us = (session_start_ns - self.start_ns) / 1000
        for event in events:
            if len(self.rows) >= MAX_EVENTS:
                self.dropped += 1
                continue
            span = event.time_range
            self.rows.append(
                [event.name, offset_us + span.start, offset_us + span.end, event.thread]
            )

    def as_rows(self) -> list[Row]:
        """The function's own row first, then its events."""
        duration_us = max(self.end_ns - self.start_ns, 0) / 1000
        return [[self.target, 0.0, duration_us, self.thread], *self.rows]


def _run_recorded(recording: Recording, step: Callable[[], Any]) -> Any:
    """Run ``step()`` in one legacy-profiler session and add its events to ``recording``."""
    started = time.perf_counter_ns()
    prof = legacy_profile()
    prof.__enter__()
    try:
        return step()
    finally:
        prof.__exit__(None, None, None)
        recording.add_session(started, prof.function_events)


class _RecordedCoroutine:
    """Awaits a coroutine one step at a time, each step in its own recording session."""

    __slots__ = ("_coro", "_recording")

    def __init__(self, coro: Awaitable[Any], recording: Recording) -> None:
        self._coro = coro
        self._recording = recording

    def __await__(self) -> Generator[Any, Any, Any]:
        recording = self._recording
        steps = self._coro.__await__()
        to_send: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                try:
                    if to_throw is None:
                        yielded = _run_recorded(recording, functools.partial(steps.send, to_send))
                    else:
                        throw = functools.partial(steps.throw, to_throw)
                        yielded = _run_recorded(recording, throw)
                except StopIteration as done:
                    return done.value
                to_send, to_throw = None, None
                try:
                    to_send = yield yielded
                except BaseException as exc:  # cancellation included: pass it in
                    to_throw = exc
        finally:
            recording.finish()


def recorded(fn: Callable[..., Any], recording: Recording, coroutine: bool) -> Callable[..., Any]:
    """``fn`` wrapped to fill ``recording`` while it runs (same calling convention:
    ``coroutine`` says whether calling ``fn`` returns an awaitable)."""
    if coroutine:

        def start_coroutine(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            recording.begin()
            return _RecordedCoroutine(fn(*args, **kwargs), recording)

        return start_coroutine

    def run(*args: Any, **kwargs: Any) -> Any:
        recording.begin()
        try:
            return _run_recorded(recording, functools.partial(fn, *args, **kwargs))
        finally:
            recording.finish()

    return run
