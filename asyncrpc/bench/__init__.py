"""``python -m asyncrpc.bench``: asyncrpc side by side with torch.distributed.rpc and a raw floor.

A tool above the library's public API (L4): each system runs in its own fresh processes
on 127.0.0.1, driven by one orchestrator that interleaves rounds between systems; see
``bench/RESULTS.md`` for the latest run and how to reproduce it. Nothing is imported here,
so the benchmark's child processes start light; the entry point is ``asyncrpc.bench.cli``.
"""

from __future__ import annotations

__all__: list[str] = []
