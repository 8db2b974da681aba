"""A driver process for the distributed autograd fault test: k0 of a group of three.

Usage: python autograd_scenarios.py INIT_METHOD. k2 is SIGKILLed inside its part of the
backward pass; prints one JSON line: the error's type, how long backward took to fail,
and the contexts left on the workers still alive.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from tests.integration import autograd_fns as fns


def main(init_method: str) -> int:
    options = asyncrpc.RpcBackendOptions(init_method=init_method, rpc_timeout=20.0)
    asyncrpc.init_rpc("k0", rank=0, world_size=3, rpc_backend_options=options)
    outcome: dict[str, object] = {"error": None}
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
    deadline = time.monotonic() + 10.0  # released in the background: poll, bounded
    while True:
        outcome["contexts_left"] = {
            "k0": asyncrpc.get_debug_info()["num_autograd_contexts"],
            "k1": asyncrpc.rpc_sync("k1", fns.num_contexts),
        }
        if outcome["contexts_left"] == {"k0": 0, "k1": 0} or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    asyncrpc.shutdown(graceful=False)
    print(json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
