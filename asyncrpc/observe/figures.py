"""Calls by kind and peer, with their latency, as a feature of the agent (layer L3).

``get_metrics()`` counts calls for the whole worker; a Prometheus scrape also wants them
by kind (``sync``, ``async``, ``remote``, ``stream``) and by callee, and how long they
took. A call hook counts them, but only once something asks for them
(``asyncrpc.metrics.serve`` turns it on): an active hook makes the outbox build an
``OutgoingCall`` per call, which costs CPU, so off it is one attribute read per call.
What it counts is read through ``get_debug_info()`` (``call_figures``), the one source
the Prometheus collector reads too: there are no second counters.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from typing import Any

from asyncrpc.runtime.calls.pipeline import CallHook, OutgoingCall
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.feature import Feature

__all__ = ["CALL_FIGURES", "LATENCY_BUCKETS", "CallFigures", "FiguresHook", "count_from_start"]

# Whether workers this process starts count from their start: a metrics endpoint is the
# process's, and is often served before init_rpc (one flag, set once, never cleared).
_from_start = False


def count_from_start() -> None:
    """Workers started from now on in this process count their calls from the start."""
    global _from_start
    _from_start = True


# Upper bounds of the latency histogram, in seconds (Prometheus' ``le``; +Inf is implied).
# From 50 µs, a loopback call on a fast machine, to 30 s, past torch's default timeout's
# half; about three buckets per decade, as Prometheus' own defaults.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class _Row:
    """The figures of one (kind, callee): counts, and the latency histogram of those ended."""

    __slots__ = ("buckets", "failed", "finished", "started", "sum_s")

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0  # ended, with a value or an error
        self.failed = 0  # of those, with an error (remote, timeout, lost peer, cancelled)
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # not cumulative; the last is +Inf
        self.sum_s = 0.0


class FiguresHook(CallHook):
    """Counts outgoing calls by kind and callee while on; their latency when they end."""

    # Its stages take a lock and wait for nothing: calls on lanes are counted on their
    # thread, and a call stays on its lane when this hook is on.
    lane_safe = True

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str], _Row] = {}

    def __repr__(self) -> str:
        return f"FiguresHook(on={self.on})"

    def active(self) -> bool:
        return self.on

    def outgoing(self, call: OutgoingCall) -> None:
        call.state[self] = time.perf_counter()
        key = (call.kind.value, call.callee)
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = _Row()
            row.started += 1

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        started = call.state.pop(self, None)
        if started is None:
            return
        elapsed = time.perf_counter() - started
        index = bisect.bisect_left(LATENCY_BUCKETS, elapsed)
        with self._lock:
            row = self._rows[(call.kind.value, call.callee)]
            row.finished += 1
            row.failed += error is not None
            row.buckets[index] += 1
            row.sum_s += elapsed

    def rows(self) -> list[dict[str, Any]]:
        """A copy of the figures, one dict per (kind, callee) called since it was on."""
        with self._lock:
            items = [(key, row) for key, row in self._rows.items()]
            return [
                {
                    "kind": kind, "peer": peer, "started": row.started,
                    "finished": row.finished, "failed": row.failed,
                    "latency_buckets": list(row.buckets), "latency_sum_s": row.sum_s,
                }
                for (kind, peer), row in items
            ]  # fmt: skip


class CallFigures(Feature):
    """The figures of one worker's outgoing calls by kind and callee (off until asked)."""

    name = "call_figures"

    def __init__(self) -> None:
        self.hook = FiguresHook()
        self.hook.on = _from_start

    def hooks(self) -> Sequence[CallHook]:
        return (self.hook,)

    def start(self) -> None:
        """Count from now on (calls already made are not in these figures)."""
        self.hook.on = True

    def debug_info(self) -> dict[str, Any]:
        if not self.hook.on:
            return {}
        return {"call_figures": self.hook.rows(), "call_latency_buckets": list(LATENCY_BUCKETS)}


CALL_FIGURES: FeatureSlot[CallFigures] = FeatureSlot("call_figures", "the call figures")
