"""Driver programs for the tests of issue 15: connections that heal, bounded waits, nested
blocking calls (test layer).

``python -m tests.integration.heal_scenarios NAME [options]`` joins a group of its own as
rank 0 ("driver"), runs one scenario and prints ``RESULT {json}`` (see ``scenarios.py``,
whose helpers and test-side half it shares).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import asyncrpc
from tests.integration import remote_fns as fns
from tests.integration.scenarios import Observations, _attempt, _options, _poll, _report


def _init(args: argparse.Namespace, **overrides: object) -> None:
    options = _options(args)
    for key, value in overrides.items():
        setattr(options, key, value)
    asyncrpc.init_rpc("driver", rank=0, world_size=args.world_size, rpc_backend_options=options)


# -- nested blocking calls deeper than the pool --------------------------------------------


def nested(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, n1, n2, n3, n4}, all workers with 4 pool threads; n3 and n4 also
    cap their pools at 4. Chains of nested ``rpc_sync`` between n1 and n2 (1 x 32, 8 x 8),
    then one too deep for the capped pair."""
    _init(args)
    obs: Observations = {}
    obs["deep"] = _attempt(lambda: asyncrpc.rpc_sync("n1", fns.chain, args=(32, "n1", "n2")))
    chains = [
        asyncrpc.rpc_async(f"n{1 + i % 2}", fns.chain, args=(8, f"n{1 + i % 2}", f"n{2 - i % 2}"))
        for i in range(8)
    ]
    obs["eight"] = _attempt(lambda: asyncrpc.wait_all(chains))
    obs["capped"] = _attempt(lambda: asyncrpc.rpc_sync("n3", fns.chain, args=(16, "n3", "n4")))
    obs["capped_after"] = _attempt(lambda: asyncrpc.rpc_sync("n3", fns.chain, args=(2, "n3", "n4")))

    def settled(name: str) -> Callable[[], bool]:
        return lambda: asyncrpc.rpc_sync(name, fns.metrics)["thread_pool_threads"] <= 4

    obs["threads_back"] = all(_poll(settled(n), 10.0) for n in ("n1", "n2"))
    obs["metrics"] = {n: asyncrpc.rpc_sync(n, fns.metrics) for n in ("n1", "n2", "n3", "n4")}
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    _report(obs)
    return 0


SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {"nested": nested}


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
    started = time.monotonic()
    code = SCENARIOS[args.scenario](args)
    print(f"scenario {args.scenario} took {time.monotonic() - started:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
