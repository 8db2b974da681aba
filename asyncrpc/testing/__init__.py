"""Helpers users and our own tests share: free ports, real worker processes, and spans kept
in memory (L4)."""

from __future__ import annotations

from asyncrpc.testing.launcher import WorkerProcess, free_port, spawn_worker, stop_workers
from asyncrpc.testing.spans import record_spans, recorded_spans

__all__ = [
    "WorkerProcess",
    "free_port",
    "record_spans",
    "recorded_spans",
    "spawn_worker",
    "stop_workers",
]
