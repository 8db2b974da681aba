"""Lanes under faults (test layer): a peer killed while a thread's call runs on its lane,
and a group with lanes turned off (``sync_lanes=0``)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import asyncrpc
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, options, poll, report
from tests.scenarios.registry import option, scenario


@scenario("lane_killed", world_size=2)
def lane_killed(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}: a thread's 30 s call to w1 runs on its lane when the test
    kills w1.

    Protocol: prints ``STARTED`` once the call runs on w1, then reads one line (the test
    writes ``KILLED`` right after SIGKILL) and observes the call, a later call and
    ``shutdown``.
    """
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options(args))
    seen: dict[str, Any] = {}
    lane_open = threading.Event()

    def caller() -> None:
        asyncrpc.rpc_sync("w1", fns.noop)
        asyncrpc.rpc_sync("w1", fns.noop)  # this thread's lane is open now
        lane_open.set()
        seen["call"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.sleep, args=(30.0,), timeout=0))
        seen["failed_at"] = time.monotonic()

    thread = threading.Thread(target=caller)
    thread.start()
    obs: Observations = {"lane_open": lane_open.wait(30.0)}
    # Two running: the sleep, and the metrics call that counts them.
    obs["running_on_w1"] = poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 2, 10.0
    )
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    killed_at = time.monotonic()
    thread.join(20.0)
    obs.update(seen)
    obs["detected_after"] = seen["failed_at"] - killed_at if "failed_at" in seen else None
    obs["later"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=10.0))
    report(obs)
    return 0


@scenario("lanes_off", option("--sync-lanes", type=int, default=0), world_size=2)
def lanes_off(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}, both with ``--sync-lanes``: calls work, and lanes open only
    where both sides take them."""
    opts = options(args, sync_lanes=args.sync_lanes)
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    values = [asyncrpc.rpc_sync("w1", fns.add, args=(i, 1)) for i in range(5)]
    metrics = asyncrpc.get_metrics()
    obs: Observations = {"values": values, "lanes_opened": metrics["lanes_opened"],
                         "lane_calls": metrics["lane_calls"]}  # fmt: skip
    obs["shutdown"] = attempt(asyncrpc.shutdown)
    report(obs)
    return 0


@scenario("busy_poll", option("--busy-poll-us", type=int, default=2000), world_size=2)
def busy_poll(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}, both polling their lanes for ``--busy-poll-us``: replies
    that come within the poll, one that comes after it (a 50 ms call), a remote error,
    and the thread's CPU time per call, which counts the polling."""
    opts = options(args, busy_poll_us=args.busy_poll_us)
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    cpu = time.thread_time()
    values = [asyncrpc.rpc_sync("w1", fns.add, args=(i, 1)) for i in range(50)]
    obs: Observations = {"values": values, "cpu_per_call": (time.thread_time() - cpu) / 50}
    obs["slow"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.sleep, args=(0.05,)))
    obs["error"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.raise_key_error, args=("k",)))
    obs["after"] = asyncrpc.rpc_sync("w1", fns.add, args=(2, 3))
    metrics = asyncrpc.get_metrics()
    obs.update({key: metrics[key] for key in ("lane_calls", "lane_polls", "lane_poll_hits")})
    obs["w1"] = {key: asyncrpc.rpc_sync("w1", fns.metrics)[key] for key in ("lane_polls",)}
    obs["shutdown"] = attempt(asyncrpc.shutdown)
    report(obs)
    return 0
