"""The distributed autograd fault scenario (test layer): k0 of a group of three.

k2 is SIGKILLed inside its part of the backward pass; observes the error's type, how long
backward took to fail, and the contexts left on the workers still alive. k0's thread has
a lane to k2 first, so the hop to k2 goes on it (``engine.root_onward``) and the thread
learns of k2's death there; ``--no-lanes``: k0 has none, the hop goes the loop's way.
"""

from __future__ import annotations

import argparse
import time

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from tests.integration import autograd_fns as fns
from tests.scenarios.common import options, poll, report
from tests.scenarios.registry import option, scenario


@scenario(
    "autograd_killed_in_backward",
    option("--no-lanes", action="store_true", help="sync_lanes=0 on k0"),
    rpc_timeout=20.0,
    shutdown_timeout=60.0,
)
def autograd_killed_in_backward(args: argparse.Namespace) -> int:
    """Rank 0 of {k0, k1, k2}: k2 dies inside its part of the backward pass."""
    lanes = {"sync_lanes": 0} if args.no_lanes else {}
    asyncrpc.init_rpc("k0", rank=0, world_size=3, rpc_backend_options=options(args, **lanes))
    outcome: dict[str, object] = {"error": None}
    for _ in range(2):  # the second call to k2 opens this thread's lane to it, if it may
        asyncrpc.rpc_sync("k2", fns.num_contexts)
    on_lane = asyncrpc.get_debug_info()["autograd_root_hops_on_lane"]
    a = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        h = asyncrpc.rpc_sync("k1", fns.echo, args=(a,))  # k1 takes part too
        y = asyncrpc.rpc_sync("k2", fns.die_in_backward, args=(h,))
        started = time.monotonic()
        try:
            dist_autograd.backward(context_id, [y.sum()])
        except Exception as exc:
            outcome["error"] = type(exc).__name__
        outcome["seconds"] = round(time.monotonic() - started, 3)
    outcome["hops_on_lane"] = asyncrpc.get_debug_info()["autograd_root_hops_on_lane"] - on_lane

    def contexts_left() -> bool:
        outcome["contexts_left"] = {
            "k0": asyncrpc.get_debug_info()["num_autograd_contexts"],
            "k1": asyncrpc.rpc_sync("k1", fns.num_contexts),
        }
        return outcome["contexts_left"] == {"k0": 0, "k1": 0}

    poll(contexts_left, 10.0)  # released in the background: poll, bounded
    asyncrpc.shutdown(graceful=False)
    report(outcome)
    return 0
