"""Writes the callee's events into the chrome traces torch's profilers export (layer L3).

torch's kineto profilers write ``export_chrome_trace`` from the C++ trace they collected,
not from the Python event list ``merge.py`` extends, so the remote events of RPCs are
missing there. ``install`` extends ``torch.autograd.profiler.profile.export_chrome_trace``
(which ``torch.profiler.profile`` calls for ``.json``, ``.json.gz`` and
``tensorboard_trace_handler`` alike): after torch has written the file, the remote events
of that profile are added as complete (``"X"``) events on the track of their RPC's span,
inside its time range, so viewers nest them under it; their ``args`` name the callee
(``node_id``, ``worker``). A trace with no remote events is left as torch wrote it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from asyncrpc.profiling.names import REMOTE_OP

__all__ = ["extend_export", "remote_trace_events"]

_log = logging.getLogger(__name__)


def callee_of(name: str) -> str | None:
    """The worker that ran the remote event ``name`` (``span#remote_op: op``): the callee
    of the innermost RPC span in the name."""
    span = name.rsplit(REMOTE_OP, 1)[0]
    _, arrow, callee = span.rpartition(" -> ")
    return callee[:-1] if arrow and callee.endswith(")") else None


def remote_trace_events(events: list[Any], trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chrome trace events for the remote ``FunctionEvent``s among ``events``.

    Each goes on the track (pid, tid) of the trace event of its RPC's span, shifted by that
    span's offset between the two time bases (the event list's µs since the profile's start,
    the trace's µs of kineto's clock).
    """
    # The earliest span of each name in both: the same event (the shift is one constant).
    spans: dict[str, Any] = {}
    for event in events:
        first = spans.get(event.name)
        if not event.is_remote and (
            first is None or event.time_range.start < first.time_range.start
        ):
            spans[event.name] = event
    tracks: dict[str, tuple[Any, Any, float]] = {}
    for record in sorted((r for r in trace if r.get("ph") == "X"), key=lambda r: float(r["ts"])):
        local = spans.get(record.get("name", ""))
        if local is not None and local.name not in tracks:
            shift = float(record["ts"]) - local.time_range.start
            tracks[local.name] = (record["pid"], record["tid"], shift)
    added = []
    for event in events:
        if not event.is_remote:
            continue
        span = event.name.split(REMOTE_OP, 1)[0]
        track = tracks.get(span)
        if track is None:
            continue  # its RPC's span is not in this trace (another cycle of a schedule)
        pid, tid, shift = track
        added.append({
            "ph": "X", "cat": "rpc_remote_op", "name": event.name, "pid": pid, "tid": tid,
            "ts": event.time_range.start + shift, "dur": event.time_range.elapsed_us(),
            "args": {"node_id": event.node_id, "worker": callee_of(event.name)},
        })  # fmt: skip
    return added


def _add_to_file(path: str, events: list[Any]) -> None:
    if not any(event.is_remote for event in events):
        return
    with open(path, encoding="utf-8") as source:
        document = json.load(source)
    trace = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(trace, list):
        _log.warning("chrome trace %s has no traceEvents: remote RPC events left out", path)
        return
    trace.extend(remote_trace_events(events, trace))
    with open(path, "w", encoding="utf-8") as target:
        json.dump(document, target)


def extend_export(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a kineto profile's ``export_chrome_trace``: torch writes, then we add."""

    def export_chrome_trace(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, path, *args, **kwargs)
        if getattr(self, "kineto_results", None) is None:
            return result  # written from the event list: remote events are in it already
        self._ensure_function_events()  # merges the remote events (merge.py)
        events = self._function_events
        if events is not None and not str(path).endswith(".gz"):
            _add_to_file(str(path), list(events))
        return result

    return export_chrome_trace
