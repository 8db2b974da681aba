"""Statistics every system's client reports, computed the same way for all of them.

Part of ``asyncrpc.bench``; plain Python (no torch), so the floor's processes stay light.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrpc.bench.config import MIB

__all__ = ["echo_stats", "latency_stats", "min_echo_iterations", "throughput_stats"]


def latency_stats(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50/p99/mean in microseconds of round-trip samples in nanoseconds."""
    ordered = sorted(samples_ns)
    n = len(ordered)
    return {
        "p50_us": ordered[n // 2] / 1e3,
        "p99_us": ordered[min(n - 1, int(n * 0.99))] / 1e3,
        "mean_us": sum(ordered) / n / 1e3,
        "n": n,
    }


def throughput_stats(calls: int, elapsed_s: float) -> dict[str, float]:
    """Calls per second over the whole measurement, drain included."""
    return {"calls_per_s": calls / elapsed_s, "n": calls, "elapsed_s": elapsed_s}


def echo_stats(size: int, times_ns: Sequence[int]) -> dict[str, float]:
    """Median echo time, and bandwidth as 2 x bytes / median time (MB = 10^6 bytes)."""
    ordered = sorted(times_ns)
    median = ordered[len(ordered) // 2]
    return {"p50_ms": median / 1e6, "mb_per_s": 2 * size / (median / 1e9) / 1e6, "n": len(ordered)}


def min_echo_iterations(size: int) -> int:
    """Echoes per round at the least, however long they take."""
    return 3 if size >= 16 * MIB else 10
