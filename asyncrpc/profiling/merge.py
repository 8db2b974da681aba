"""Puts events recorded on other workers into the caller's torch profiler (layer L3).

torch has no public way to add another process's events to a running profiler: its own
RPC agent hands them to the C++ legacy profiler, which ``torch.profiler.profile`` (kineto)
does not read. So the first remote recording to arrive installs one small extension of
``torch.autograd.profiler.profile._ensure_function_events`` (what ``events()``,
``key_averages()``, ``table()`` and ``export_chrome_trace()`` of both ``torch.profiler.profile``
and ``torch.autograd.profiler.profile`` build their event list with): after torch builds
the list, the remote events that arrived during that profiler's window are appended,
placed inside the local span of the RPC that brought them. Without that method (another
torch), remote events are dropped with one warning; local spans still work.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any

from torch.autograd import profiler as torch_profiler
from torch.autograd.profiler_util import EventList, FunctionEvent

from asyncrpc.profiling.names import remote_event_name

__all__ = ["RemoteBatch", "deliver", "to_function_events"]

_log = logging.getLogger("asyncrpc.profiling")

# Bounded: batches nobody reads (a profile whose events are never asked for) age out.
MAX_BATCHES = 10_000


class RemoteBatch:
    """The events of one RPC's callee, as the caller received them."""

    __slots__ = ("callee_rank", "received_ns", "rows", "span")

    def __init__(self, span: str, callee_rank: int, rows: list[list[Any]]) -> None:
        self.span = span  # the caller's span name of that RPC
        self.callee_rank = callee_rank
        self.rows = rows
        self.received_ns = time.perf_counter_ns()  # the clock torch's window uses


# Process-wide, like torch's profiler itself: one per process, whichever thread runs it.
_batches: collections.deque[RemoteBatch] = collections.deque(maxlen=MAX_BATCHES)
_lock = threading.Lock()
_installed = False
_ids = itertools.count(1 << 40)  # clear of the ids torch gives its own events


def deliver(batch: RemoteBatch) -> None:
    """Keep ``batch`` for the profiler that is running now (from any thread)."""
    _install_once()
    with _lock:
        _batches.append(batch)


def to_function_events(
    rows: list[list[Any]], name: Any, start_us: float, node_id: int
) -> list[FunctionEvent]:
    """``FunctionEvent``s of ``rows``, named by ``name(row_name)``, shifted to ``start_us``.

    Their parents and children are not linked yet: build the tree of the list they go in.
    """
    events = []
    for row_name, start, end, thread in rows:
        event = FunctionEvent(
            id=next(_ids),
            name=name(row_name),
            thread=int(thread),
            start_us=start_us + float(start),
            end_us=start_us + float(end),
            input_shapes=[],
            stack=[],
            is_remote=node_id >= 0,
            node_id=node_id,
        )
        events.append(event)
    return events


def _take(start_ns: int, end_ns: int) -> list[RemoteBatch]:
    with _lock:
        taken = [b for b in _batches if start_ns <= b.received_ns <= end_ns]
        if taken:
            kept = [b for b in _batches if b.received_ns > end_ns]
            _batches.clear()
            _batches.extend(kept)
    return taken


def _merge(prof: Any) -> None:
    events = prof._function_events
    if events is None or getattr(prof, "_asyncrpc_merged", None) is events:
        return  # not built, or built and merged already (a profile is re-entered per step)
    prof._asyncrpc_merged = events
    start_ns = getattr(prof, "profiling_start_time_ns", 0)
    end_ns = getattr(prof, "profiling_end_time_ns", 0) or time.perf_counter_ns()
    batches = _take(start_ns, end_ns)
    if not batches:
        return
    # Each batch goes inside the local span of its RPC (the n-th batch of a span name in
    # the n-th local event of that name), centred: the two clocks are not comparable.
    spans: dict[str, list[Any]] = collections.defaultdict(list)
    for event in events:
        if event.name.startswith("rpc_"):
            spans[event.name].append(event)
    used: collections.Counter[str] = collections.Counter()
    for batch in batches:
        local = spans.get(batch.span, [])
        anchor = local[min(used[batch.span], len(local) - 1)] if local else None
        used[batch.span] += 1
        remote_us = float(batch.rows[0][2]) if batch.rows else 0.0
        start_us = 0.0
        if anchor is not None:
            span = anchor.time_range
            start_us = span.start + max(span.end - span.start - remote_us, 0.0) / 2
        name = _namer(batch.span)
        remote = EventList(to_function_events(batch.rows, name, start_us, batch.callee_rank))
        remote._build_tree()  # parents and children by time, for self times
        events.extend(remote)


def _namer(span: str) -> Any:
    return lambda event: remote_event_name(span, event)


def _install_once() -> None:
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        original = getattr(torch_profiler.profile, "_ensure_function_events", None)
        if original is None:
            _log.warning("this torch cannot take remote profiler events; only local RPC spans")
            return

        def ensure_function_events(self: Any) -> None:
            original(self)
            _merge(self)

        torch_profiler.profile._ensure_function_events = ensure_function_events  # type: ignore[method-assign]
