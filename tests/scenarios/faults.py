"""Scenarios where a peer fails under the driver (test layer): SIGKILLed mid-call,
hung by SIGSTOP, and faults injected by a proxy in front of each worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import threading
import time
import weakref
from typing import Any

import asyncrpc
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, options, poll, report
from tests.scenarios.registry import option, scenario

# -- scenario: a peer is SIGKILLed in the middle of a call --------------------------------


@scenario("kill_peer", option("--graceful", type=int, choices=(0, 1), default=1))
def kill_peer(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2}: a long call to w1 is pending when the test kills w1.

    Protocol: prints ``STARTED`` once the call runs on w1, then reads one line (the test
    writes ``KILLED`` right after SIGKILL) and observes the pending call, a later call, calls
    to w2 and ``shutdown``.
    """
    asyncrpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=options(args))
    obs: Observations = {"w1_pid": asyncrpc.rpc_sync("w1", fns.pid)}
    failed_at: list[float] = []
    called_back = threading.Event()
    losses: list[tuple[str, str, float]] = []
    asyncrpc.on_peer_lost(lambda e: losses.append((e.worker, e.reason, time.monotonic())))
    stopped: list[str] = []
    asyncrpc.on_peer_lost(lambda e: stopped.append(e.worker))()  # stopped at once

    def note_failure(_: object) -> None:
        failed_at.append(time.monotonic())
        called_back.set()

    long_call = asyncrpc.rpc_async("w1", fns.sleep, args=(30.0,), timeout=0)
    long_call.add_done_callback(note_failure)
    w2_in_flight = asyncrpc.rpc_async("w2", fns.sleep, args=(1.0,))
    obs["running_on_w1"] = poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 1, 5.0
    )
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    obs["pending"] = attempt(lambda: long_call.wait(5.0))
    # The done callback runs on the callback pool, possibly after wait() returned.
    called_back.wait(5.0)
    obs["pending_failed_at"] = failed_at[0] if failed_at else None
    obs["later_w1"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    # Locals of functions whose calls to the lost peer failed, the errors caught and
    # dropped: nothing of the worker's (the lost peer's error, kept for good) holds them.
    held = [_call_holding_a_local("w1") for _ in range(2)]
    gc.collect()
    obs["locals_kept_after_failed_calls"] = [ref() is not None for ref in held]
    obs["w2_in_flight"] = attempt(lambda: w2_in_flight.wait(5.0))
    obs["later_w2"] = attempt(lambda: asyncrpc.rpc_sync("w2", fns.add, args=(1, 2)))
    obs["debug_lost_peers"] = asyncrpc.get_debug_info()["lost_peers"]
    poll(lambda: bool(losses), 5.0)
    obs["losses"] = [[worker, reason] for worker, reason, _ in losses]
    obs["stopped_watcher"] = list(stopped)
    obs["loss_told_after"] = losses[0][2] - failed_at[0] if losses and failed_at else None
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=bool(args.graceful), timeout=5.0))
    obs["not_initialized_after"] = attempt(asyncrpc.get_worker_info)["error"]
    report(obs)
    return 0


class _Local:
    """Stands for what a user's frame holds while its call fails (a batch, an RRef)."""


def _call_holding_a_local(to: str) -> weakref.ref[_Local]:
    batch = _Local()
    with contextlib.suppress(asyncrpc.PeerLostError):
        asyncrpc.rpc_sync(to, fns.add, args=(1, 2))
    return weakref.ref(batch)


# -- scenario: a peer whose graceful shutdown fails still says Goodbye ---------------------


@scenario("failed_shutdown")
def failed_shutdown(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}; w1 called shutdown on joining with a short timeout and this
    worker does not shut down meanwhile, so w1's shutdown fails: w1 leaves all the same,
    and says so (Goodbye). This worker learns w1 is gone without calling it."""
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options(args))
    losses: list[str] = []
    asyncrpc.on_peer_lost(lambda e: losses.append(e.worker))
    obs: Observations = {"w1_answers": asyncrpc.rpc_sync("w1", fns.add, args=(1, 2))}
    obs["lost_without_a_call"] = poll(lambda: "w1" in asyncrpc.get_debug_info()["lost_peers"], 20.0)
    time.sleep(0.2)  # the callback pool would have run a watcher by now
    obs["losses"] = list(losses)  # w1 said Goodbye: it left, it was not lost
    obs["call_after"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


# -- scenario: a peer's program ends without calling shutdown() ---------------------------


@scenario("forgets_shutdown", option("--role", choices=("stayer", "leaver"), default="stayer"))
def forgets_shutdown(args: argparse.Namespace) -> int:
    """{stayer (rank 0), leaver (rank 1)}: the leaver's program ends without shutdown().

    Leaver: prints ``STARTED`` once joined, reads one line, reports, and returns (its
    process exits, with its worker still running). Stayer: prints ``STARTED`` once two
    long calls run on the leaver (one from the loop's path, one blocking on a thread's
    lane), then observes them, a later call once the leaver is declared lost, and a
    non-graceful shutdown (a graceful one would wait for the leaver).
    """
    if args.role == "leaver":
        asyncrpc.init_rpc("leaver", rank=1, world_size=2, rpc_backend_options=options(args))
        print("STARTED", flush=True)
        report({"stdin": sys.stdin.readline().strip()})
        return 0  # no shutdown(): the mistake under test
    asyncrpc.init_rpc("stayer", rank=0, world_size=2, rpc_backend_options=options(args))
    long_call = asyncrpc.rpc_async("leaver", fns.sleep, args=(60.0,), timeout=0)
    # A thread's blocking call goes on its own lane from its second call on.
    on_lane: dict[str, Any] = {}

    def blocking_call() -> None:
        asyncrpc.rpc_sync("leaver", fns.add, args=(1, 2))
        on_lane.update(attempt(lambda: asyncrpc.rpc_sync("leaver", fns.sleep, args=(60.0,))))

    caller = threading.Thread(target=blocking_call, daemon=True)
    caller.start()
    obs: Observations = {
        "running": poll(
            lambda: asyncrpc.rpc_sync("leaver", fns.metrics)["running_requests"] >= 2, 10.0
        )
    }
    print("STARTED", flush=True)
    obs["pending"] = attempt(lambda: long_call.wait(20.0))
    caller.join(20.0)
    obs["pending_blocking"] = on_lane
    obs["declared_lost"] = poll(lambda: "leaver" in asyncrpc.get_debug_info()["lost_peers"], 10.0)
    obs["later"] = attempt(lambda: asyncrpc.rpc_sync("leaver", fns.add, args=(1, 2)))
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


# -- scenario: a peer hangs (SIGSTOP) with calls pending ----------------------------------


@scenario("hang_peer")
def hang_peer(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2}, heartbeats every 0.2 s, silence limit 1 s.

    Protocol: prints ``STARTED`` once a call with no timeout runs on w1, reads one line (the
    test writes ``STOPPED`` right after SIGSTOP), then observes that call, a later call,
    w2 (under load meanwhile: no false positive), and a graceful shutdown.
    """
    opts = options(args)
    opts.heartbeat_interval, opts.heartbeat_timeout = 0.2, 1.0
    asyncrpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=opts)
    obs: Observations = {}
    stuck = asyncrpc.rpc_async("w1", fns.sleep, args=(60.0,), timeout=0)
    obs["running_on_w1"] = poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 1, 5.0
    )
    # The probe of a peer is trusted once its listener has answered from here: a peer
    # stopped in its very first moments is found by silence alone (silent_link_timeout).
    obs["checked"] = poll(lambda: asyncrpc.get_metrics()["liveness_checked"] >= 2, 10.0)
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    stopped_at = time.monotonic()
    # w2 stays busy with a long call and many short ones: it must not be declared lost.
    w2_long = asyncrpc.rpc_async("w2", fns.sleep, args=(3.0,), timeout=0)
    w2_calls = [asyncrpc.rpc_async("w2", fns.add, args=(i, 1)) for i in range(256)]
    obs["pending"] = attempt(lambda: stuck.wait(30.0))
    obs["detected_after"] = time.monotonic() - stopped_at
    obs["later_w1"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    obs["w2_long"] = attempt(lambda: w2_long.wait(10.0))
    obs["w2_calls_ok"] = asyncrpc.wait_all(w2_calls) == [i + 1 for i in range(256)]
    obs["debug_lost_peers"] = asyncrpc.get_debug_info()["lost_peers"]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=5.0))
    report(obs)
    return 0


# -- scenario: faults injected by a proxy in front of each worker ---------------------------


class _Ledger:
    """Every call made, how it ended, and whether its reply was its own payload."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def echo(self, worker: str, tag: str, size: int = 16, timeout: float = 0) -> Any:
        import torch

        data = torch.full((size,), float(len(self.calls)))
        payload = {"tag": tag, "data": data}
        entry: dict[str, Any] = {"ended": 0, "ok": None, "error": None}
        self.calls[tag] = entry

        def ended(done: Any) -> None:
            with self._lock:
                entry["ended"] += 1
                exc = done.exception()
                if exc is None:
                    back = done.value()
                    entry["ok"] = back["tag"] == tag and bool(torch.equal(back["data"], data))
                else:
                    entry["error"] = type(exc).__name__

        future = asyncrpc.rpc_async(worker, fns.echo, args=(payload,), timeout=timeout)
        future.add_done_callback(ended)
        return future

    def summary(self) -> dict[str, Any]:
        return {
            "calls": len(self.calls),
            "ended_once": all(e["ended"] == 1 for e in self.calls.values()),
            "mismatched": sum(1 for e in self.calls.values() if e["ok"] is False),
            "by_tag": self.calls,
        }


@scenario("faults", option("--proxies", required=True))
def faults(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, f1..f4}; fi listens on a fixed port behind a FaultProxy that this
    process runs (``--proxies`` lists listen:proxy ports). f1 is delayed, f2 black-holed,
    f3 dropped, f4 cut mid-frame; heartbeats every 0.2 s, silence limit 1 s."""
    from asyncrpc.testing.faultproxy import FaultProxy

    pairs = [tuple(int(p) for p in item.split(":")) for item in args.proxies.split(",")]
    proxies = {f"f{i + 1}": FaultProxy(target, port) for i, (target, port) in enumerate(pairs)}
    opts = options(args)
    opts.heartbeat_interval, opts.heartbeat_timeout = 0.2, 1.0
    # A black-holed link to a live worker: its process answers the probe (on its lane
    # listener, not behind the proxy), so only this limit declares it lost.
    opts.silent_link_timeout = 2.0
    opts.unix_sockets = False  # through the proxies, which sit on TCP
    asyncrpc.init_rpc("driver", rank=0, world_size=5, rpc_backend_options=opts)
    ledger, obs = _Ledger(), Observations()
    for name in proxies:  # connect through each proxy first
        ledger.echo(name, f"{name}-warm").wait(10)
    # Delay: calls are slow, not lost.
    proxies["f1"].delay(0.3)
    started = time.monotonic()
    ledger.echo("f1", "f1-delayed").wait(10)
    obs["f1_delayed_s"] = time.monotonic() - started
    proxies["f1"].heal()
    # Black hole: only heartbeats can tell; the pending call fails typed.
    pending = [ledger.echo("f2", f"f2-{i}") for i in range(3)]
    proxies["f2"].blackhole()
    stuck = asyncrpc.rpc_async("f2", fns.sleep, args=(30.0,), timeout=0)
    started = time.monotonic()
    obs["f2_stuck"] = attempt(lambda: stuck.wait(20))
    obs["f2_detected_s"] = time.monotonic() - started
    # Drop: a reset; the call in flight fails at once.
    slow = asyncrpc.rpc_async("f3", fns.sleep, args=(30.0,), timeout=0)
    obs["f3_running"] = poll(
        lambda: asyncrpc.rpc_sync("f3", fns.metrics)["running_requests"] >= 1, 10.0
    )
    proxies["f3"].drop()
    started = time.monotonic()
    obs["f3_pending"] = attempt(lambda: slow.wait(20))
    obs["f3_detected_s"] = time.monotonic() - started
    # Truncate: the next frame towards f4 is cut in the middle (a 1 MiB payload).
    proxies["f4"].truncate(1000)
    cut = ledger.echo("f4", "f4-cut", size=1 << 18)
    obs["f4_cut"] = attempt(lambda: cut.wait(20))
    obs["later_f4"] = attempt(lambda: ledger.echo("f4", "f4-later").wait(5))
    obs["f1_after"] = attempt(lambda: ledger.echo("f1", "f1-after").wait(10) is not None)
    for future in pending:
        with contextlib.suppress(Exception):
            future.wait(5)
    # Done callbacks run on the callback pool, maybe after wait() returned: wait for each.
    obs["all_ended"] = poll(lambda: all(e["ended"] for e in ledger.calls.values()), 10.0)
    obs["ledger"] = ledger.summary()
    obs["metrics"] = asyncrpc.get_metrics()
    asyncrpc.shutdown(graceful=False)
    for proxy in proxies.values():
        proxy.close()
    report(obs)
    return 0


# -- scenario: a peer hangs (SIGSTOP) under the default heartbeat ----------------------------


@scenario("hang_defaults")
def hang_defaults(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2, w3}, every worker with the default heartbeat options.

    w1 owns an RRef the driver holds and has called w2 (which watches it with
    ``on_caller_lost``); w3's event loop is held by a 4 s ``@inline`` function. Prints
    ``STARTED`` once a call with no timeout runs on w1, reads one line (the test writes
    ``STOPPED`` right after it SIGSTOPs w1), then observes how w1's loss is found and told,
    and that w3, blocked but alive, is not lost.
    """
    asyncrpc.init_rpc("driver", rank=0, world_size=4, rpc_backend_options=options(args))
    obs: Observations = {}
    events: list[list[Any]] = []
    watching = asyncrpc.membership()

    async def collect() -> None:
        async for event in watching:
            events.append([event.kind, event.worker.name, event.evidence, time.monotonic()])

    threading.Thread(target=asyncio.run, args=(collect(),), daemon=True).start()
    losses: list[tuple[str, str, float]] = []
    asyncrpc.on_peer_lost(lambda e: losses.append((e.worker, e.evidence, time.monotonic())))
    rref = asyncrpc.remote("w1", fns.add, args=(1, 2))
    obs["rref_value"] = rref.to_here()
    owner_lost: list[tuple[str, float]] = []
    rref.on_owner_lost(lambda e: owner_lost.append((e.evidence, time.monotonic())))
    obs["w1_registered"] = asyncrpc.rpc_sync("w1", fns.register_with, args=("w2",))
    stuck = asyncrpc.rpc_async("w1", fns.sleep, args=(60.0,), timeout=0)
    failed_at: list[float] = []
    stuck.add_done_callback(lambda _: failed_at.append(time.monotonic()))
    obs["running_on_w1"] = poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 1, 5.0
    )
    # Each probe is trusted once the peer's listener has answered from here (see
    # hang_peer): the driver's of w1, w2 and w3, and w2's of w1.
    obs["checked"] = poll(
        lambda: (
            asyncrpc.get_metrics()["liveness_checked"] >= 3
            and asyncrpc.rpc_sync("w2", fns.metrics)["liveness_checked"] >= 1
        ),
        10.0,
    )
    blocked = asyncrpc.rpc_async("w3", fns.busy_inline, args=(4.0,), timeout=0)
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    stopped_at = time.monotonic()
    obs["pending"] = attempt(lambda: stuck.wait(30.0))
    obs["detected_after"] = time.monotonic() - stopped_at
    obs["pending_evidence"] = getattr(stuck.exception(), "evidence", None)
    obs["blocked_w3"] = attempt(lambda: blocked.wait(30.0))
    poll(lambda: bool(owner_lost) and bool(losses) and len(events) >= 1 and bool(failed_at), 5.0)
    obs["owner_lost"] = [evidence for evidence, _ in owner_lost]
    obs["losses"] = [[worker, evidence] for worker, evidence, _ in losses]
    obs["events"] = [event[:3] for event in events]
    if losses and failed_at and owner_lost and events:
        # After the pending call failed (the declaration), each told within:
        obs["told_after_s"] = {
            "on_peer_lost": losses[0][2] - failed_at[0],
            "on_owner_lost": owner_lost[0][1] - failed_at[0],
            "membership": events[0][3] - failed_at[0],
        }
    obs["w2_caller_losses"] = None
    deadline = time.monotonic() + 20.0  # past silent_link_timeout, whatever w2 knew
    while time.monotonic() < deadline:  # w2 finds w1 gone by its own heartbeat
        seen = asyncrpc.rpc_sync("w2", fns.caller_losses)
        if seen:
            obs["w2_caller_losses"] = seen
            break
        time.sleep(0.05)
    debug = asyncrpc.get_debug_info()
    obs["lost_peers"] = debug["lost_peers"]
    obs["liveness_probes"] = debug["liveness_probes"]
    obs["probes_unanswered"] = debug["probes_unanswered"]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=10.0))
    report(obs)
    return 0
