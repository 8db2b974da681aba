"""Deadlines enforced by the callee and inherited by nested calls, between real processes
(the shared group: this process is the driver, w1 and w3 synchronous workers, w2 an
asynchronous one)."""

from __future__ import annotations

import time

import pytest

import asyncrpc
from tests.integration import deadline_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def _stopped_at(worker: str, key: str, within: float) -> tuple[float, str]:
    """When, and by what, ``worker``'s function under ``key`` was stopped (polled)."""
    stop = time.monotonic() + within
    while time.monotonic() < stop:  # bounded by ``within``
        state = asyncrpc.rpc_sync(worker, fns.seen, args=(key,))
        if isinstance(state, list | tuple) and state[0] == "stopped":
            return float(state[1]), str(state[2])
        time.sleep(0.05)
    raise AssertionError(f"{worker} never stopped {key}: {state!r}")


def test_a_chain_stops_everywhere_at_the_first_caller_s_deadline(group: Group) -> None:
    # driver -> w1 (relay, async def) -> w2 (sleeper, async def, 10 s): the driver's 1 s
    # budget reaches w2 through w1's call, which has no timeout of its own.
    started = time.time()
    with pytest.raises(asyncrpc.RpcTimeoutError):
        asyncrpc.rpc_sync("w1", fns.relay, args=("chain", "w2", 10.0), timeout=1.0)
    failed = time.time() - started
    w1_at, w1_by = _stopped_at("w1", "chain", 5.0)
    w2_at, w2_by = _stopped_at("w2", "chain", 5.0)
    # w1 stops by the driver's cancel or by its own call's inherited timeout, whichever
    # comes first (both at the deadline); w2's sleep is cancelled either way.
    assert w1_by in ("CancelledError", "RpcTimeoutError")
    assert w2_by == "CancelledError"
    w1, w2 = w1_at - started, w2_at - started
    assert failed < 5.0
    assert max(w1, w2) < 5.0  # far before the 10 s the sleep would have taken
    print(f"caller failed at {failed:.3f} s, w1 stopped at {w1:.3f} s ({w1_by}), "
          f"w2 at {w2:.3f} s")  # fmt: skip


def test_a_def_reads_what_is_left_of_its_caller_s_budget(group: Group) -> None:
    left = asyncrpc.rpc_sync("w1", fns.remaining, timeout=5.0)
    assert left is not None
    assert 4.0 < left <= 5.0
    assert asyncrpc.rpc_sync("w1", fns.remaining, timeout=0) is None  # no deadline


def test_a_nested_call_inherits_the_rest_of_the_budget(group: Group) -> None:
    mine, nested = asyncrpc.rpc_sync("w1", fns.nested_remaining, args=("w3",), timeout=5.0)
    assert mine is not None
    assert nested is not None
    assert 3.0 < nested <= mine <= 5.0  # less than w3's own 30 s default timeout
