"""Connections both sides left idle close after ``idle_timeout`` (issue 38, part 4), with
real worker processes on 127.0.0.1: the next call dials again and succeeds, a call that
runs longer than the timeout keeps its connection, and a call in flight never fails for
it. The test prints what a call costs just after such a close (the reconnect) against a
call on a live connection; it asserts no time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrpc.testing import free_port

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]

_WORKER = """
import json, statistics, sys, time
import asyncrpc

rank, init, idle = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
options = asyncrpc.RpcBackendOptions(init_method=init, idle_timeout=idle, sync_lanes=0)
asyncrpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
out = {}
if rank == 0:
    def metric(name):
        return asyncrpc.get_metrics()[name]

    def wait_closed(closed_before, limit=10.0):
        end = time.monotonic() + limit
        while metric("connections_idle_closed") == closed_before:  # bounded by limit
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def call(fn, *args):
        return asyncrpc.rpc_async("w1", fn, args=args).wait()

    out["first"] = call(max, 1, 2)
    out["self"] = asyncrpc.rpc_async("w0", max, args=(9, 1)).wait()  # the loopback too
    out["open_after_call"] = metric("open_connections")
    out["closed_when_idle"] = wait_closed(0)
    out["open_when_idle"] = metric("open_connections")
    out["lost"] = metric("connections_lost")
    out["again"] = call(max, 3, 4)  # dials again
    # A call that runs four timeouts long: its connection stays, and it returns.
    closed = metric("connections_idle_closed")
    out["slow"] = call(time.sleep, 4 * idle)
    out["closed_during_slow"] = metric("connections_idle_closed") - closed
    # What a call costs just after an idle close, and on the live connection after it.
    cold, warm = [], []
    for _ in range(int(sys.argv[4])):
        wait_closed(metric("connections_idle_closed"))
        start = time.perf_counter()
        call(max, 5, 6)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        call(max, 7, 8)
        warm.append(time.perf_counter() - start)
    out["cold_ms"] = 1000 * statistics.median(cold) if cold else None
    out["warm_ms"] = 1000 * statistics.median(warm) if warm else None
    out["failed"] = metric("calls_failed")
    out["metrics_closed"] = metric("connections_idle_closed")
asyncrpc.shutdown()
print(json.dumps(out))
"""


# Lanes (rpc_sync from a user thread on the thread's own connection) close too.
_LANE_WORKER = """
import json, statistics, sys, threading, time
import asyncrpc

rank, init, idle = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
options = asyncrpc.RpcBackendOptions(init_method=init, idle_timeout=idle)
asyncrpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
out = {}
if rank == 0:
    def metric(name):
        return asyncrpc.get_metrics()[name]

    def until(condition, limit=10.0):
        end = time.monotonic() + limit
        while not condition():  # bounded by limit
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def run():
        out["calls"] = [asyncrpc.rpc_sync("w1", max, args=(i, 1)) for i in range(3)]
        out["lanes_open"] = metric("lanes_open")  # the second call opened this thread's
        out["closed_when_idle"] = until(lambda: metric("lanes_idle_closed") >= 1)
        out["lanes_open_when_idle"] = metric("lanes_open")
        lane_calls = metric("lane_calls")
        out["again"] = asyncrpc.rpc_sync("w1", max, args=(3, 4))  # a new lane
        out["again_on_a_lane"] = metric("lane_calls") - lane_calls
        closed = metric("lanes_idle_closed")
        out["slow"] = asyncrpc.rpc_sync("w1", time.sleep, args=(4 * idle,))
        out["closed_during_slow"] = metric("lanes_idle_closed") - closed
        # What a call costs just after its lane closed (a new lane: dial and handshake on
        # this thread), and on the live lane after it.
        cold, warm = [], []
        for _ in range(int(sys.argv[4])):
            closed = metric("lanes_idle_closed")
            until(lambda: metric("lanes_idle_closed") > closed)
            start = time.perf_counter()
            asyncrpc.rpc_sync("w1", max, args=(5, 6))
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            asyncrpc.rpc_sync("w1", max, args=(7, 8))
            warm.append(time.perf_counter() - start)
        out["cold_ms"] = 1000 * statistics.median(cold) if cold else None
        out["warm_ms"] = 1000 * statistics.median(warm) if warm else None
        out["failed"] = metric("calls_failed")

    thread = threading.Thread(target=run)  # a user thread: its own lanes
    thread.start()
    thread.join(60)
asyncrpc.shutdown()
print(json.dumps(out))
"""


def _run(idle: float, rounds: int, script: str = _WORKER) -> dict[str, object]:
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), init, str(idle), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        results = [proc.communicate(timeout=150) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    return dict(json.loads(results[0][0].strip().splitlines()[-1]))


def test_idle_connections_close_and_the_next_call_dials_again() -> None:
    out = _run(idle=0.3, rounds=int(os.environ.get("IDLE_ROUNDS", "5")))
    print(f"a call after an idle close: {out['cold_ms']:.2f} ms (median); on the live "
          f"connection after it: {out['warm_ms']:.2f} ms")  # fmt: skip
    assert out["first"] == 2
    assert out["self"] == 9
    assert out["open_after_call"] == 1
    assert out["closed_when_idle"] is True
    assert out["open_when_idle"] == 0
    assert out["lost"] == 0  # closed on purpose, not lost
    assert out["again"] == 4
    assert out["slow"] is None
    assert out["closed_during_slow"] == 0
    assert out["failed"] == 0


def test_idle_lanes_close_and_the_threads_next_call_opens_another() -> None:
    out = _run(idle=0.3, rounds=int(os.environ.get("IDLE_ROUNDS", "5")), script=_LANE_WORKER)
    print(f"an rpc_sync after its lane closed: {out['cold_ms']:.2f} ms (median); on the live "
          f"lane after it: {out['warm_ms']:.2f} ms")  # fmt: skip
    assert out["calls"] == [1, 1, 2]
    assert out["lanes_open"] == 1
    assert out["closed_when_idle"] is True
    assert out["lanes_open_when_idle"] == 0
    assert out["again"] == 4
    assert out["again_on_a_lane"] == 1
    assert out["slow"] is None
    assert out["closed_during_slow"] == 0  # a call in flight keeps its lane
    assert out["failed"] == 0
