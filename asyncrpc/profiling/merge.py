"""Puts events recorded on other workers into the caller's torch profiler (layer L3).

torch has no public way to add another process's events to a running profiler: its own
RPC agent hands them to the C++ legacy profiler. So when the first worker of this process
starts, this module extends the two profiler classes every torch profiler is built on,
each by a few lines around torch's own methods:

- ``torch.autograd.profiler.profile`` (under ``torch.profiler.profile`` too): its
  ``_ensure_function_events``, which ``events()``, ``key_averages()``, ``table()`` and
  ``export_chrome_trace()`` build their event list with;
- ``torch.autograd.profiler_legacy.profile``: its ``__exit__``, which builds
  ``function_events``.

After torch builds the list, the remote events that arrived during that profile's window
are appended, each RPC's placed inside the local span of that RPC, and the profile's local
events get this worker's rank as ``node_id`` (as torch's agent marks them); ``trace.py``
writes them into the chrome trace kineto exports too. Both classes
also note which profiles run, so a call asks its callee for input shapes or memory when
the caller's profile records them. Without those methods (another torch), remote events
are dropped with one warning; local spans still work.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.autograd import profiler as torch_profiler
from torch.autograd import profiler_legacy
from torch.autograd.profiler_util import EventList, FunctionEvent

from asyncrpc.profiling.names import remote_event_name
from asyncrpc.profiling.recorder import (
    ASKED,
    MEMORY,
    SHAPES,
    Row,
    centred_offset,
    relabel,
)
from asyncrpc.profiling.trace import extend_export

__all__ = ["RemoteBatch", "deliver", "install", "requested_flags", "to_function_events"]

_log = logging.getLogger(__name__)

# Bounded: batches nobody reads (a profile whose events are never asked for) age out.
MAX_BATCHES = 10_000

# The prefixes of the span names of RPCs (see names.py): a profile with one is an RPC one.
SPAN_PREFIXES = ("rpc_sync#", "rpc_async#", "rpc_remote#", "rpc_stream#")


class RemoteBatch:
    """The events of one RPC's callee, as the caller received them."""

    __slots__ = ("callee_rank", "received_ns", "rows", "span")

    def __init__(self, span: str, callee_rank: int, rows: list[Row]) -> None:
        self.span = span  # the caller's span name of that RPC
        self.callee_rank = callee_rank
        self.rows = rows
        self.received_ns = time.perf_counter_ns()  # the clock torch's window uses


# Process-wide, like torch's profiler itself: one per process, whichever thread runs it.
_batches: collections.deque[RemoteBatch] = collections.deque(maxlen=MAX_BATCHES)
_lock = threading.Lock()
_running: list[Any] = []  # the profiles (of both classes) between start and exit
_installed = False
_node_id = -1  # this worker's rank, once it made a call while profiling
_ids = iter(range(1 << 40, 1 << 62))  # clear of the ids torch gives its own events


def set_node_id(rank: int) -> None:
    global _node_id
    _node_id = rank


def requested_flags() -> int:
    """What to ask a callee to record: what the profiles running now record."""
    flags = ASKED
    for prof in tuple(_running):
        if getattr(prof, "record_shapes", False):
            flags |= SHAPES
        if getattr(prof, "profile_memory", False):
            flags |= MEMORY
    return flags


def deliver(batch: RemoteBatch) -> None:
    """Keep ``batch`` for the profiler that is running now (from any thread)."""
    with _lock:
        _batches.append(batch)


def to_function_events(rows: list[Row]) -> list[FunctionEvent]:
    """``FunctionEvent``s of ``rows`` (final names, times in µs and nodes).

    Their parents and children are not linked yet: build the tree of the list they go in.
    """
    return [
        FunctionEvent(
            id=next(_ids), name=name, trace_name=name, thread=int(thread), start_us=float(start),
            end_us=float(end), input_shapes=shapes or [], stack=[], node_id=int(node),
            is_remote=node >= 0, cpu_memory_usage=int(memory or 0),
        )
        for name, start, end, thread, node, shapes, memory in rows
    ]  # fmt: skip


def _take(start_ns: int, end_ns: int) -> list[RemoteBatch]:
    with _lock:
        taken = [b for b in _batches if start_ns <= b.received_ns <= end_ns]
        if taken:
            kept = [b for b in _batches if b.received_ns > end_ns]
            _batches.clear()
            _batches.extend(kept)
    return taken


def _merge(events: list[Any], start_ns: int, end_ns: int) -> None:
    """Append the batches received in [start_ns, end_ns] to ``events``, a built list."""
    batches = _take(start_ns, end_ns)
    spans: dict[str, list[Any]] = collections.defaultdict(list)
    for event in events:
        if event.name.startswith(SPAN_PREFIXES):
            spans[event.name].append(event)
    if not batches and not spans:
        return  # no RPC in this profile: leave it as torch made it
    if _node_id >= 0:
        for event in events:
            if event.node_id < 0:
                event.node_id = _node_id
    # Each batch goes inside the local span of its RPC (the n-th batch of a span name in
    # the n-th local event of that name).
    used: collections.Counter[str] = collections.Counter()
    for batch in batches:
        local = spans.get(batch.span, [])
        anchor = local[min(used[batch.span], len(local) - 1)] if local else None
        used[batch.span] += 1
        offset_us = 0.0
        if anchor is not None:
            span = anchor.time_range
            offset_us = centred_offset(span.start, span.end, batch.rows)
        rows = relabel(batch.rows, _namer(batch.span), offset_us, batch.callee_rank)
        remote = EventList(to_function_events(rows))
        remote._build_tree()  # parents and children by time, for self times
        events.extend(remote)


def _namer(span: str) -> Callable[[str], str]:
    return lambda event: remote_event_name(span, event)


# -- the extensions of torch's profiler classes -------------------------------------------


def _started(prof: Any) -> None:
    prof._asyncrpc_start_ns = time.perf_counter_ns()
    with _lock:
        _running.append(prof)


def _stopped(prof: Any) -> None:
    with _lock:
        if prof in _running:
            _running.remove(prof)


def _kineto_ensure(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def ensure_function_events(self: Any) -> None:
        original(self)
        events = self._function_events
        if events is None or getattr(self, "_asyncrpc_merged", None) is events:
            return  # not built, or built and merged already (a profile is re-entered per step)
        self._asyncrpc_merged = events
        start_ns = getattr(self, "profiling_start_time_ns", 0)
        end_ns = getattr(self, "profiling_end_time_ns", 0) or time.perf_counter_ns()
        _merge(events, start_ns, end_ns)

    return ensure_function_events


def _noting_start(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def start_trace(self: Any) -> None:
        _started(self)
        original(self)

    return start_trace


def _kineto_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def exit_profile(self: Any, *exc: Any) -> Any:
        try:
            return original(self, *exc)
        finally:
            _stopped(self)

    return exit_profile


def _legacy_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def exit_profile(self: Any, *exc: Any) -> Any:
        try:
            result = original(self, *exc)
        finally:
            _stopped(self)
        events = getattr(self, "function_events", None)
        start_ns = getattr(self, "_asyncrpc_start_ns", None)
        if events is not None and start_ns is not None:
            _merge(events, start_ns, time.perf_counter_ns())
        return result

    return exit_profile


def install() -> None:
    """Extend torch's profiler classes, once per process (see the module's docstring)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    kineto, legacy = torch_profiler.profile, profiler_legacy.profile
    names = ("_start_trace", "__exit__")
    if not all(hasattr(cls, n) for cls in (kineto, legacy) for n in names) or not hasattr(
        kineto, "_ensure_function_events"
    ):
        _log.warning("this torch cannot take remote profiler events; only local RPC spans")
        return
    kineto._ensure_function_events = _kineto_ensure(kineto._ensure_function_events)  # type: ignore[method-assign]
    kineto._start_trace = _noting_start(kineto._start_trace)  # type: ignore[method-assign]
    kineto.__exit__ = _kineto_exit(kineto.__exit__)  # type: ignore[method-assign]
    # Its chrome trace is written from kineto's own results: the remote events go in after.
    kineto.export_chrome_trace = extend_export(kineto.export_chrome_trace)  # type: ignore[method-assign]
    legacy._start_trace = _noting_start(legacy._start_trace)  # type: ignore[method-assign]
    legacy.__exit__ = _legacy_exit(legacy.__exit__)  # type: ignore[method-assign]
