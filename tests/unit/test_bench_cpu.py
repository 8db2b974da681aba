"""The bench's cost model: CPU time per call read from /proc, and its arithmetic."""

from __future__ import annotations

import os
import time

from asyncrpc.bench import cpu


def _spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (not of wall time: on a loaded machine
    a wall-clock spin may get a small share of a core)."""
    end = time.thread_time() + seconds
    give_up = time.monotonic() + 60
    while time.thread_time() < end and time.monotonic() < give_up:  # bounded both ways
        pass


def test_cpu_ns_of_this_process_grows_with_work() -> None:
    before = cpu.cpu_ns(os.getpid())
    _spin(0.05)
    after = cpu.cpu_ns(os.getpid())
    assert before is not None
    assert after is not None
    assert after - before >= 20_000_000  # at least 20 of the 50 ms spent spinning


def test_cpu_ns_of_a_process_that_does_not_exist_is_none() -> None:
    assert cpu.cpu_ns(2**22 + 12345) is None  # above the kernel's pid_max
    assert cpu.snapshot({"client": os.getpid(), "server": 2**22 + 12345}) is None


def test_add_per_call_divides_by_the_items_calls() -> None:
    outcome = {"stats": {"n": 4, "p50_us": 1.0}}
    cpu.add_per_call(outcome, {"client": 1_000, "server": 0}, {"client": 9_000, "server": 4_000})
    assert outcome["stats"]["cpu_us_client"] == 2.0
    assert outcome["stats"]["cpu_us_server"] == 1.0
    assert outcome["stats"]["cpu_us_total"] == 3.0


def test_add_per_call_counts_steps_and_leaves_failures_alone() -> None:
    steps = {"stats": {"steps": 2, "steps_per_s": 5.0}}
    cpu.add_per_call(steps, {"client": 0}, {"client": 6_000})
    assert steps["stats"]["cpu_us_total"] == 3.0
    failed = {"error": "boom"}
    cpu.add_per_call(failed, {"client": 0}, {"client": 1})
    assert failed == {"error": "boom"}
    unread = {"stats": {"n": 1}}
    cpu.add_per_call(unread, None, {"client": 1})
    assert unread == {"stats": {"n": 1}}


def test_handoffs_count_by_kind_and_read_without_advancing() -> None:
    from asyncrpc.runtime.threads import handoffs

    before = handoffs.snapshot()
    handoffs.count("loop_to_pool")
    handoffs.count("loop_to_pool")
    handoffs.count("to_waiting_thread")
    after = handoffs.snapshot()
    assert after == handoffs.snapshot()  # reading does not count
    assert after["loop_to_pool"] - before["loop_to_pool"] == 2
    assert after["to_waiting_thread"] - before["to_waiting_thread"] == 1
    assert handoffs.total() == sum(after.values())


def test_add_per_call_with_a_prefix_and_scale() -> None:
    outcome = {"stats": {"n": 10}}
    cpu.add_per_call(outcome, {"client": 0, "server": 5}, {"client": 30, "server": 15},
                     "handoffs", 1.0)  # fmt: skip
    assert outcome["stats"]["handoffs_client"] == 3.0
    assert outcome["stats"]["handoffs_server"] == 1.0
    assert outcome["stats"]["handoffs_total"] == 4.0
