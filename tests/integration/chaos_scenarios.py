"""Driver programs for regressions the chaos soak found (test layer).

``python -m tests.integration.chaos_scenarios NAME [options]`` joins a group of its own as
rank 0 ("driver"), runs one scenario and prints ``RESULT {json}`` (see ``scenarios.py``,
whose helpers and test-side half it shares).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.testing import chaos_fns as fns
from asyncrpc.testing import free_port
from asyncrpc.testing.faultproxy import FaultProxy
from tests.integration.scenarios import Observations, _options, _poll, _report


def _contexts_on(name: str) -> int:
    return asyncrpc.rpc_sync(name, fns.rref_counts, timeout=10.0)["autograd_contexts"]


def release_after_drop(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, k1}; both listen behind FaultProxies run here (``--port`` and
    ``--proxy-port`` are k1's). A context reaches k1; its release leaves into a black hole
    and the connection is then reset: k1 must still drop the context."""
    mine, my_proxy = free_port(), free_port()
    proxies = [FaultProxy(args.port, args.proxy_port), FaultProxy(mine, my_proxy)]
    options = _options(args)
    options.listen_port, options.advertise_port, options.unix_sockets = mine, my_proxy, False
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)
    obs: Observations = {}
    layer = asyncrpc.remote("k1", fns.make_layer, args=(0,))
    with dist_autograd.context() as context_id:
        _, y = asyncrpc.rpc_sync("k1", fns.forward, args=("k", layer, torch.ones(2, 8)))
        dist_autograd.backward(context_id, [y.sum()])
        obs["during"] = _contexts_on("k1")
        for proxy in proxies:
            proxy.blackhole()
    # The release is on its way into the black hole; then the link resets.
    _poll(lambda: False, 0.3)
    for proxy in proxies:
        proxy.drop()
        proxy.heal()
    obs["released"] = _poll(lambda: _contexts_on("k1") == 0, 15.0)
    obs["after"] = _contexts_on("k1")
    del layer
    asyncrpc.shutdown(timeout=20.0)
    for proxy in proxies:
        proxy.close()
    _report(obs)
    return 0


SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {
    "release_after_drop": release_after_drop,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rpc-timeout", type=float, default=20.0)
    parser.add_argument("--shutdown-timeout", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--proxy-port", type=int, default=0)
    args = parser.parse_args(argv)
    return SCENARIOS[args.scenario](args)


if __name__ == "__main__":
    sys.exit(main())
