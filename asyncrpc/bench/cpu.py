"""CPU time per call of every process of a benchmarked system, measured around each item.

Part of ``asyncrpc.bench``; plain Python (no torch). Wall figures on a shared VM move 2-4x
between hours; the CPU time one call costs the client and the server moves far less, so
the report gives both. The time is read from ``/proc/<pid>/task/*/schedstat``: nanoseconds
on a CPU, user and system together, summed over every thread of the process (a busy-polling
thread counts: it is part of what a call costs on that machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["add_per_call", "cpu_ns", "snapshot"]

# Stats fields that count the calls (or steps, or updates) an item made, in this order.
_COUNTS = ("n", "steps", "updates")


def cpu_ns(pid: int) -> int | None:
    """Nanoseconds process ``pid`` has spent on a CPU, or None where /proc cannot say."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile: its time is lost either way
    return total


def snapshot(pids: Mapping[str, int]) -> dict[str, int] | None:
    """CPU nanoseconds of each role's process, or None if one cannot be read."""
    taken = {role: cpu_ns(pid) for role, pid in pids.items()}
    if any(value is None for value in taken.values()):
        return None
    return {role: value for role, value in taken.items() if value is not None}


def add_per_call(
    outcome: dict[str, Any],
    before: dict[str, int] | None,
    after: dict[str, int] | None,
    prefix: str = "cpu_us",
    scale: float = 1e-3,
) -> None:
    """Add ``<prefix>_<role>`` and ``<prefix>_total`` (per call, each difference times
    ``scale``: nanoseconds to microseconds by default) to an item's stats, when it has
    stats, counts its calls and both snapshots were taken."""
    stats = outcome.get("stats")
    if not isinstance(stats, dict) or before is None or after is None:
        return
    calls = next((stats[k] for k in _COUNTS if isinstance(stats.get(k), int | float)), 0)
    if not calls:
        return
    per_role = {role: (after[role] - before[role]) * scale / calls for role in before}
    for role, value in per_role.items():
        stats[f"{prefix}_{role}"] = value
    stats[f"{prefix}_total"] = sum(per_role.values())
