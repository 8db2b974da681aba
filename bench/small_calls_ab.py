"""A/B of two small-call optimisations of issue 13, each turned off by patching it out.

    python bench/small_calls_ab.py [ROUNDS]

"off" restores the behaviour before: builtin torch ops always run on the callee's thread
pool, and an RRef sent to its owner is forked like any other. Each round starts a fresh
pair of processes per variant (off, then on) and measures the p50 of 2,000 calls of
``torch.add`` on 2x2 tensors and of the dist-autograd forward ``forward(layer_rref, x)``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc
from asyncrpc.bench import workloads

CALLS = 2000


def _forking_dump(self: Any, obj: object, dest: object, made: list[Any]) -> Any:
    """``Forks.dump`` as it was before: every RRef pickled is a new fork."""
    from asyncrpc.rref import forks
    from asyncrpc.rref.handle import RRef

    if not isinstance(obj, RRef):
        return None
    with self._lock:
        if obj._fork_id is None:
            fork_id = self.counter.fork_from_owner(obj._rref_id, dest)
        else:
            fork_id = self.counter.fork_from_user(obj._rref_id, obj._fork_id, dest)
    if dest != self.rank:
        made.append((obj._rref_id, fork_id))
    return (forks._TAG, *obj._rref_id, *fork_id, obj._owner, self.rank)


def _turn_off() -> None:
    from asyncrpc.rref.forks import Forks
    from asyncrpc.runtime.calls import dispatch

    dispatch.runs_on_loop = lambda fn, args, kwargs: False  # type: ignore[assignment]
    Forks.dump = _forking_dump  # type: ignore[method-assign]


def _p50_us(call: Callable[[], object]) -> float:
    for _ in range(300):
        call()
    samples = []
    for _ in range(CALLS):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def run(rank: int, path: str, variant: str, results: Any) -> None:
    if variant == "off":
        _turn_off()
    options = asyncrpc.RpcBackendOptions(init_method=f"file://{path}")
    asyncrpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        small = torch.ones(2, 2)
        layer = asyncrpc.remote("w1", workloads.make_layer)
        x = torch.randn(32, 64)
        results.put(
            {
                "torch.add": _p50_us(lambda: asyncrpc.rpc_sync("w1", torch.add, (small, small))),
                "forward(rref)": _p50_us(
                    lambda: asyncrpc.rpc_sync("w1", workloads.forward, (layer, x))
                ),
            }
        )
    asyncrpc.shutdown()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    ctx = mp.get_context("spawn")
    found: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for variant in ("off", "on"):
            results = ctx.Queue()
            path = tempfile.mktemp()
            procs = [ctx.Process(target=run, args=(r, path, variant, results)) for r in (0, 1)]
            for proc in procs:
                proc.start()
            found[variant].append(results.get(timeout=120))
            for proc in procs:
                proc.join(60)
    for key in ("torch.add", "forward(rref)"):
        off = [r[key] for r in found["off"]]
        on = [r[key] for r in found["on"]]
        ratio = statistics.median(on) / statistics.median(off)
        print(f"{key}: before {[round(v) for v in off]} µs, after {[round(v) for v in on]} µs, "
              f"median after/before {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
