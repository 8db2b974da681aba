"""Helpers users and our own tests share: free ports and real worker processes (L4)."""

from __future__ import annotations

from asyncrpc.testing.launcher import WorkerProcess, free_port, spawn_worker, stop_workers

__all__ = ["WorkerProcess", "free_port", "spawn_worker", "stop_workers"]
