"""Records what a request runs on the callee: the function's span, the torch ops inside
it and the RPCs it makes, on the thread that runs it (layer L3).

torch's kineto profiler is one per process, so the callee records with the legacy profiler,
which is per thread (torch's own RPC agent does the same on its server threads). A
synchronous function is recorded in one session; an ``async def`` function in one session
per step of its coroutine, so ops of other requests interleaved on the loop are not counted.
An ``@async_execution`` function is recorded until it returns its future. An RPC the
function makes is recorded by hand (see ``hook.py``): its span, and what its own callee
recorded, nested inside it.

A recording is a list of rows (see ``Row``), msgpack-able, with times relative to the start
of the function; its first row is the function itself.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from torch.autograd.profiler_legacy import profile as legacy_profile
from torch.autograd.profiler_util import MEMORY_EVENT_NAME

__all__ = [
    "ASKED",
    "MAX_EVENTS",
    "MEMORY",
    "SHAPES",
    "Recording",
    "Row",
    "centred_offset",
    "current_recording",
    "recorded",
    "relabel",
]

# A reply carries at most this many events (a loop of small ops can make millions).
MAX_EVENTS = 5000

# The caller's request (the value of the header field): a bit set of what to record.
ASKED = 1  # record this call
SHAPES = 2  # with the ops' input shapes (the caller profiles with record_shapes=True)
MEMORY = 4  # with the memory each op allocated (profile_memory=True)

# A row: [name, start_us, end_us, thread, node_id, input_shapes, cpu_memory_usage].
# node_id -1 means "the worker that recorded it"; a row that came from further away (an
# RPC the function made) carries the rank of the worker that ran it.
Row = list[Any]
NAME, START, END, THREAD, NODE, SHAPES_AT, MEMORY_AT = range(7)

_current = threading.local()


def current_recording() -> Recording | None:
    """The recording of the request this thread is running now, if any."""
    return getattr(_current, "recording", None)


class Recording:
    """The events of one request, filled while it runs (by its thread, and by the loop
    for the RPCs it makes)."""

    __slots__ = ("dropped", "end_ns", "flags", "rows", "start_ns", "target", "thread")

    def __init__(self, target: str, flags: int = ASKED) -> None:
        self.target = target
        self.flags = flags
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

    def offset_us(self, at_ns: int) -> float:
        """``at_ns`` (``perf_counter_ns``) in this recording's µs."""
        return (at_ns - self.start_ns) / 1000

    def add(self, rows: list[Row]) -> None:
        room = MAX_EVENTS - len(self.rows)
        self.dropped += max(len(rows) - room, 0)
        self.rows.extend(rows[: max(room, 0)])

    def add_session(self, session_start_ns: int, events: Any) -> None:
        offset_us = self.offset_us(session_start_ns)
        rows = []
        for event in events:
            if event.name == MEMORY_EVENT_NAME:
                continue  # a bare allocation outside any op: no time span to place it in
            span = event.time_range
            rows.append([
                event.name, offset_us + span.start, offset_us + span.end, event.thread, -1,
                event.input_shapes or None, event.cpu_memory_usage,
            ])  # fmt: skip
        self.add(rows)

    def as_rows(self) -> list[Row]:
        """The function's own row first, then its events."""
        duration_us = max(self.end_ns - self.start_ns, 0) / 1000
        return [[self.target, 0.0, duration_us, self.thread, -1, None, 0], *self.rows]


def relabel(rows: list[Row], name: Callable[[str], str], offset_us: float, node: int) -> list[Row]:
    """``rows`` renamed by ``name``, shifted by ``offset_us``; those recorded by the worker
    that sent them (node -1) are marked ``node``."""
    return [
        [name(row[NAME]), row[START] + offset_us, row[END] + offset_us, row[THREAD],
         node if row[NODE] < 0 else row[NODE], row[SHAPES_AT], row[MEMORY_AT]]
        for row in rows
    ]  # fmt: skip


def centred_offset(span_start_us: float, span_end_us: float, rows: list[Row]) -> float:
    """Where ``rows`` (from another worker's clock, from 0) start inside a local span:
    centred in it, as the two clocks are not comparable."""
    remote_us = max((float(row[END]) for row in rows), default=0.0)
    return span_start_us + max(span_end_us - span_start_us - remote_us, 0.0) / 2


def _run_recorded(recording: Recording, step: Callable[[], Any]) -> Any:
    """Run ``step()`` in one legacy-profiler session and add its events to ``recording``."""
    flags = recording.flags
    prof = legacy_profile(record_shapes=bool(flags & SHAPES), profile_memory=bool(flags & MEMORY))
    outer = current_recording()
    started = time.perf_counter_ns()
    prof.__enter__()
    _current.recording = recording
    try:
        return step()
    finally:
        _current.recording = outer
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
