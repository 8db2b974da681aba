"""Counts of work handed from one thread to another, by kind (layer L2.01).

Each hand-off costs a wake-up (tens of microseconds on a busy VM), and the count per call
is a figure that, unlike wall time, does not move with the machine's load: the bench
reports it per call beside CPU time. Counters are per process (one agent per process is
the rule) and cost one C-level ``next()`` each: ``itertools.count`` is atomic under the
GIL where ``+= 1`` on a shared int is not.
"""

from __future__ import annotations

import itertools

__all__ = ["KINDS", "count", "snapshot", "statistics", "total"]

# thread_to_loop: a caller's thread (rpc_sync, rpc_async) hands a call to the agent's loop.
# loop_to_pool: the loop queues a job (a def function, a local pass) for a pool thread.
# pool_to_loop: a pool thread wakes the loop with finished jobs (batched: one per batch).
# to_waiting_thread: a completed future wakes a thread blocked in wait().
# to_callback_loop: a completed future schedules its callbacks on a loop of another thread.
# to_callback_pool: callbacks registered from synchronous code go to the callback pool.
# to_awaiting_loop: a completed future wakes an ``await`` on a loop of another thread.
KINDS = (
    "thread_to_loop",
    "loop_to_pool",
    "pool_to_loop",
    "to_waiting_thread",
    "to_callback_loop",
    "to_callback_pool",
    "to_awaiting_loop",
)

_counters = {kind: itertools.count() for kind in KINDS}
_tick = {kind: counter.__next__ for kind, counter in _counters.items()}


def count(kind: str) -> None:
    """Count one hand-off of ``kind`` (one of ``KINDS``)."""
    _tick[kind]()


def _value(counter: itertools.count[int]) -> int:
    # A count's repr is "count(N)", N being the next value: reading it does not advance it.
    return int(repr(counter)[6:-1])


def snapshot() -> dict[str, int]:
    """Hand-offs of each kind so far in this process."""
    return {kind: _value(counter) for kind, counter in _counters.items()}


def statistics() -> dict[str, int]:
    """The hand-offs of each kind so far in this process, as ``get_metrics`` names them."""
    return {f"handoffs_{kind}": n for kind, n in snapshot().items()}


def total() -> int:
    """All hand-offs so far in this process."""
    return sum(snapshot().values())
