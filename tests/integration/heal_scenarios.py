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


# -- frame limits known to both sides -------------------------------------------------------

MIB = 1 << 20


def frames(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, m1}; both take frames of at most 1 MiB. Oversized messages both
    ways, each followed by normal calls on the same connection."""
    import torch

    _init(args, max_frame_size=MIB, heartbeat_interval=0.0)  # no pings between the counts
    obs: Observations = {}
    obs["warm"] = _attempt(lambda: asyncrpc.rpc_sync("m1", fns.add, args=(1, 2)))
    before = asyncrpc.get_metrics()
    big = torch.zeros(2 * MIB, dtype=torch.uint8)
    obs["send_big"] = _attempt(lambda: asyncrpc.rpc_sync("m1", fns.storage_nbytes, args=(big,)))
    after = asyncrpc.get_metrics()
    obs["bytes_written"] = after["bytes_out"] - before["bytes_out"]
    obs["connections_lost"] = after["connections_lost"]
    half = torch.zeros(MIB // 2, dtype=torch.uint8)
    obs["send_half"] = _attempt(lambda: asyncrpc.rpc_sync("m1", fns.storage_nbytes, args=(half,)))
    obs["reply_big"] = _attempt(lambda: asyncrpc.rpc_sync("m1", fns.zeros, args=(2 * MIB,)))
    obs["reply_half"] = _attempt(
        lambda: int(asyncrpc.rpc_sync("m1", fns.zeros, args=(MIB // 2,)).numel())
    )
    obs["connections_opened"] = asyncrpc.get_metrics()["connections_opened"]
    obs["m1_metrics"] = asyncrpc.rpc_sync("m1", fns.metrics)
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    _report(obs)
    return 0


SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {"nested": nested, "frames": frames}


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
