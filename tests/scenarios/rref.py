"""Scenarios of RRefs under faults (test layer): owners and users SIGKILLed, graceful
shutdown with live RRefs. Each joins a group of its own; those that need a kill print
``READY`` and read one line (the test writes ``KILLED`` right after SIGKILL)."""

from __future__ import annotations

import argparse
import functools
import gc
import time
from typing import Any

import asyncrpc
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, handshake, poll, report
from tests.scenarios.common import options as common_options
from tests.scenarios.common import poll_value as _poll
from tests.scenarios.registry import scenario

DEBUG_KEYS = ("owner_rrefs", "user_rrefs", "pending_forks", "pending_users")
# A driver of four by default, as rank 0 (``leak_checked_member`` takes --name and --rank).
_DEFAULTS = {"rank": 0, "world_size": 4, "shutdown_timeout": 20.0}


# -- helpers -------------------------------------------------------------------------------


def _options(args: argparse.Namespace, rref_leaks: str = "warn") -> asyncrpc.RpcBackendOptions:
    return common_options(args, rref_leaks=rref_leaks)


def _local_debug() -> dict[str, int]:
    gc.collect()
    info = asyncrpc.get_debug_info()
    return {k: info[k] for k in DEBUG_KEYS}


def _debug(worker: str) -> dict[str, int]:
    if worker == asyncrpc.get_worker_info().name:
        return _local_debug()
    return dict(asyncrpc.rpc_sync(worker, fns.rref_debug))


def _settled(info: dict[str, int]) -> bool:
    return info["pending_users"] == 0 and info["pending_forks"] == 0


# -- scenario: the owner is killed ---------------------------------------------------------


def _owner_killed_setup(obs: Observations) -> tuple[asyncrpc.RRef[Any], asyncrpc.Future[Any]]:
    counter = asyncrpc.remote("w1", fns.make_counter, args=(5,))
    obs["before_value"] = counter.to_here().count
    slow = asyncrpc.remote("w1", fns.sleep, args=(30.0,), timeout=0)
    failed_at: list[float] = []
    pending = slow.to_here_future(timeout=0)
    pending.add_done_callback(lambda _: failed_at.append(time.monotonic()))
    obs["failed_at"] = failed_at
    for holder in ("w2", "w3"):  # user -> user forks: w2 and w3 hold it too
        asyncrpc.rpc_sync(holder, fns.hold, args=(counter,))
        obs[f"{holder}_settled"] = _settled(_poll(functools.partial(_debug, holder), _settled, 5.0))
    obs["before_driver"] = _local_debug()
    obs["before_w2"] = _debug("w2")
    return counter, pending


@scenario("owner_killed", **_DEFAULTS)
def owner_killed(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2, w3}: driver, w2 and w3 hold user RRefs owned by w1, one
    of whose values is still computing, when the test SIGKILLs w1."""
    asyncrpc.init_rpc("driver", rank=0, world_size=4, rpc_backend_options=_options(args))
    obs: Observations = {"w1_pid": asyncrpc.rpc_sync("w1", fns.pid)}
    counter, pending = _owner_killed_setup(obs)
    handshake(obs)
    obs["to_here_first"] = attempt(counter.to_here)  # may race the loss being noticed
    obs["pending_to_here"] = attempt(lambda: pending.wait(10.0))
    obs["to_here"] = attempt(counter.to_here)
    obs["rpc_sync_proxy"] = attempt(lambda: counter.rpc_sync().value())
    obs["rpc_async_proxy"] = attempt(lambda: counter.rpc_async().value().wait(10.0))
    obs["remote_proxy"] = attempt(lambda: counter.remote().value().to_here())
    obs["held_on_w2"] = attempt(lambda: asyncrpc.rpc_sync("w2", fns.fetch_held, args=(0,)))
    obs["identity"] = [counter.owner_name(), counter.is_owner()]
    obs["after_driver"] = _poll(_local_debug, lambda i: i["user_rrefs"] == 0, 5.0)
    obs["after_w2"] = _poll(lambda: _debug("w2"), lambda i: i["user_rrefs"] == 0, 5.0)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=5.0))
    report(obs)
    return 0


# -- scenario: a user is killed ------------------------------------------------------------


def _user_killed_setup(obs: Observations) -> None:
    shared = asyncrpc.RRef(fns.Counter(7))  # owned here; w1, then w2 and w3 through w1
    only_w1 = asyncrpc.RRef("held by w1 only")
    asyncrpc.rpc_sync("w1", fns.hold, args=(shared,))
    asyncrpc.rpc_sync("w1", fns.hold, args=(only_w1,))
    for holder in ("w2", "w3"):
        asyncrpc.rpc_sync("w1", fns.forward_held, args=(0, holder))
    # Owner RRefs here created by w1's remote(): three fetched, one still computing.
    obs["w1_holds"] = asyncrpc.rpc_sync("w1", fns.hold_remotes, args=("driver", 3, 3.0))
    del shared, only_w1
    for worker in ("w1", "w2", "w3"):
        obs[f"{worker}_settled"] = _settled(_poll(functools.partial(_debug, worker), _settled, 5.0))
    obs["before_driver"] = _local_debug()


@scenario("user_killed", **_DEFAULTS)
def user_killed(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2, w3}: the driver owns RRefs that w1 holds (some passed on
    to w2 and w3, some made by w1's remote()) when the test SIGKILLs w1."""
    asyncrpc.init_rpc("driver", rank=0, world_size=4, rpc_backend_options=_options(args))
    obs: Observations = {"w1_pid": asyncrpc.rpc_sync("w1", fns.pid)}
    _user_killed_setup(obs)
    handshake(obs)
    # Only the RRef that w2 and w3 still hold may survive the loss of w1.
    obs["after_kill"] = _poll(_local_debug, lambda i: i["owner_rrefs"] <= 1, 5.0)
    obs["reclaimed_after"] = time.monotonic() - obs["resumed_at"]
    obs["held_on_w2"] = attempt(lambda: asyncrpc.rpc_sync("w2", fns.fetch_held, args=(0,)).count)
    obs["dropped"] = [asyncrpc.rpc_sync(w, fns.drop_held) for w in ("w2", "w3")]
    obs["after_drop"] = _poll(_local_debug, lambda i: i["owner_rrefs"] == 0, 5.0)
    # The remote() value that was computing (3 s on a pool thread here) finishes: it must be
    # discarded. Wait for that thread to be done, then for a round trip through this loop
    # (the value's hand-off to the loop comes before the reply), not a sleep of 3.5 s.
    obs["late_value_done"] = poll(lambda: asyncrpc.get_metrics()["thread_pool_busy"] == 0, 10.0)
    asyncrpc.rpc_sync("w2", fns.add, args=(1, 1))
    obs["after_late_value"] = _local_debug()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=5.0))
    report(obs)
    return 0


# -- scenario: graceful shutdown while users still hold RRefs ------------------------------


def _live_rrefs_setup(obs: Observations) -> list[asyncrpc.RRef[Any]]:
    on_w3 = asyncrpc.remote("w3", fns.make_counter, args=(1,))
    here = asyncrpc.RRef(fns.Counter(2))
    for holder in ("w1", "w2"):
        asyncrpc.rpc_sync(holder, fns.hold, args=(on_w3,))
        asyncrpc.rpc_sync(holder, fns.hold, args=(here,))
    obs["w1_forwards"] = asyncrpc.rpc_sync("w1", fns.forward_held, args=(0, "w2"))
    asyncrpc.rpc_sync("w2", fns.hold_remotes, args=("w3", 2))
    obs["w2_holds"] = asyncrpc.rpc_sync("w2", fns.hold_remotes, args=("driver", 2))
    for worker in ("w1", "w2"):
        obs[f"{worker}_before"] = _poll(functools.partial(_debug, worker), _settled, 5.0)
    obs["w3_before"] = _debug("w3")
    obs["driver_remotely_held"] = len(current_agent().forks.owner_leaks())  # type: ignore[union-attr]
    return [on_w3, here]


@scenario("live_rrefs_shutdown", **_DEFAULTS)
def live_rrefs_shutdown(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2, w3} with ``rref_leaks="error"``: w1 and w2 hold user RRefs
    owned by the driver and by w3 (and the driver keeps its own) when everyone shuts down."""
    asyncrpc.init_rpc(
        "driver", rank=0, world_size=4, rpc_backend_options=_options(args, rref_leaks="error")
    )
    obs: Observations = {}
    kept = _live_rrefs_setup(obs)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
    obs["kept_owner_names"] = [r.owner_name() for r in kept]
    del kept  # releasing after shutdown must be a quiet no-op
    gc.collect()
    report(obs)
    return 0 if obs["shutdown"]["error"] is None else 3


@scenario("leak_checked_member", **_DEFAULTS)
def leak_checked_member(args: argparse.Namespace) -> int:
    """Join as ``--name``/``--rank`` with ``rref_leaks="error"``, serve, shut down gracefully.

    Exits 3 when the shutdown failed (a leak among them), 0 otherwise.
    """
    asyncrpc.init_rpc(
        args.name,
        rank=args.rank,
        world_size=args.world_size,
        rpc_backend_options=_options(args, rref_leaks="error"),
    )
    obs: Observations = {"shutdown": attempt(asyncrpc.shutdown)}
    report(obs)
    return 0 if obs["shutdown"]["error"] is None else 3
