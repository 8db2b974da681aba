"""Scenarios of shared memory (test layer): rank 0 of {driver, w1}, where w1 is started by
the test; the kill scenarios print ``HELD`` and wait for the test's ``KILLED`` line."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable

import torch

import asyncrpc
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, poll, report
from tests.scenarios.registry import option, scenario

MIB_FLOATS = 1 << 18  # a float32 tensor of 1 MiB
# Every shm scenario's own flags: shared memory on or off here, and this side's arena.
_SHM = (
    option("--shared-memory", type=int, choices=(0, 1), default=1),
    option("--arena-bytes", type=int, default=1 << 30),
)


def _join(args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=20.0,
        shared_memory=bool(args.shared_memory),
        shm_arena_bytes=args.arena_bytes,
    )
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)


def _metrics() -> dict[str, int]:
    return {k: v for k, v in asyncrpc.get_metrics().items() if k.startswith("shm_")}


def _share_with_w1() -> bool:
    """Make both sides probe each other (the first large segments go over the socket)."""
    big = torch.ones(MIB_FLOATS)
    asyncrpc.rpc_sync("w1", fns.echo, args=(big,))
    return poll(
        lambda: (
            asyncrpc.rpc_sync("w1", fns.echo, args=(big,)) is not None
            and _metrics()["shm_peers"] == 1
            and asyncrpc.rpc_sync("w1", fns.metrics)["shm_peers"] == 1
        ),
        10.0,
    )


@scenario("arena_full", *_SHM)
def arena_full(args: argparse.Namespace) -> int:
    """A 2 MiB arena, eight 1 MiB tensors held by w1: the rest go over the socket, intact."""
    _join(args)
    obs: Observations = {"shared": _share_with_w1()}
    for i in range(8):
        asyncrpc.rpc_sync("w1", fns.hold, args=(torch.full((MIB_FLOATS,), float(i)),))
    obs["sums"] = asyncrpc.rpc_sync("w1", fns.held_sums)
    obs["while_held"] = _metrics()
    asyncrpc.rpc_sync("w1", fns.drop_held)
    obs["returned"] = poll(lambda: _metrics()["shm_lent_bytes"] == 0, 10.0)
    obs["after"] = _metrics()
    asyncrpc.shutdown()
    report(obs)
    return 0


@scenario("disabled", *_SHM)
def disabled(args: argparse.Namespace) -> int:
    """``shared_memory=False`` here: nothing is shared in either direction."""
    _join(args)
    big = torch.arange(4 * MIB_FLOATS, dtype=torch.float32)
    obs: Observations = {
        "equal": all(
            torch.equal(asyncrpc.rpc_sync("w1", fns.echo, args=(big,)), big) for _ in range(5)
        ),
        "driver": _metrics(),
        "w1": {k: v for k, v in asyncrpc.rpc_sync("w1", fns.metrics).items() if "shm" in k},
    }
    asyncrpc.shutdown()
    report(obs)
    return 0


def _after_kill(obs: Observations, check: Callable[[], None]) -> int:
    print("HELD", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    obs["lost"] = poll(lambda: "w1" in asyncrpc.get_debug_info()["lost_peers"], 10.0)
    check()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("kill_receiver", *_SHM)
def kill_receiver(args: argparse.Namespace) -> int:
    """w1 holds tensors in our chunks and is SIGKILLed: the chunks come back to the arena."""
    _join(args)
    obs: Observations = {"shared": _share_with_w1()}
    for i in range(3):
        asyncrpc.rpc_sync("w1", fns.hold, args=(torch.full((MIB_FLOATS,), float(i)),))
    obs["lent_before"] = _metrics()["shm_lent_bytes"]

    def check() -> None:
        obs["returned"] = poll(lambda: _metrics()["shm_lent_bytes"] == 0, 10.0)
        obs["after"] = _metrics()

    return _after_kill(obs, check)


@scenario("kill_sender", *_SHM)
def kill_sender(args: argparse.Namespace) -> int:
    """We hold tensors in w1's chunks and w1 is SIGKILLed: they stay readable, and once
    dropped no mapping of w1's memory is left in this process."""
    _join(args)
    obs: Observations = {"shared": _share_with_w1()}
    w1_pid = asyncrpc.rpc_sync("w1", fns.pid)
    held = [asyncrpc.rpc_sync("w1", fns.filled, args=(MIB_FLOATS, float(i))) for i in range(3)]
    obs["mapped_before"] = fns.mapped_chunks_of(w1_pid)

    def check() -> None:
        obs["sums_after_kill"] = [float(t.sum()) for t in held]
        held.clear()
        gc.collect()
        obs["unmapped"] = poll(lambda: fns.mapped_chunks_of(w1_pid) == 0, 10.0)

    return _after_kill(obs, check)
