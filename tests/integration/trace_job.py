"""``python -m tests.integration.trace_job``: one worker (t0, t1, t2) of the tracing test.

Every worker sets a tracer provider exporting into memory (unless ``--no-provider``); t0
makes traced calls of each kind, each inside a span of its own, then gathers every
worker's finished spans and prints them as one JSON line after ``SPANS ``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.testing import record_spans, recorded_spans
from tests.integration import trace_fns as fns


def scenario() -> tuple[dict[str, int], int]:
    """Each user span's trace id, by what it covers; how many calls of "sizes_sync"
    went on a lane."""
    from opentelemetry import trace

    tracer = trace.get_tracer("trace_job")
    roots: dict[str, int] = {}

    def root(name: str) -> Any:
        return tracer.start_as_current_span(name)

    with root("chain") as span:  # t0 -> t1 -> t2, one trace
        roots["chain"] = span.get_span_context().trace_id
        assert asyncrpc.rpc_sync("t1", fns.hop, args=("t2", 1)) == 20
    with root("async_chain") as span:  # an async def on t1 calls t2 from its loop
        roots["async_chain"] = span.get_span_context().trace_id
        assert asyncrpc.rpc_async("t1", fns.async_hop, args=("t2", 1)).wait() == 20
    with root("remote") as span:
        roots["remote"] = span.get_span_context().trace_id
        assert asyncrpc.remote("t2", fns.leaf, args=(4,)).to_here() == 5
    with root("stream") as span:
        roots["stream"] = span.get_span_context().trace_id
        assert list(asyncrpc.stream("t1", fns.count, 3)) == [0, 1, 2]
    with root("error") as span:
        roots["error"] = span.get_span_context().trace_id
        with contextlib.suppress(KeyError):
            asyncrpc.rpc_sync("t1", fns.fail)
    # Message sizes. The tensors travel inside the frames: shared memory is off here.
    half = torch.zeros(1 << 17)  # 512 KiB of float32: under the lanes' 1 MiB limit
    asyncrpc.rpc_sync("t1", fns.leaf, args=(0,))  # this thread's lane opens at the next
    lane_calls = asyncrpc.get_metrics()["lane_calls"]
    with root("sizes_sync") as span:  # a plain sync call from this thread: on its lane
        roots["sizes_sync"] = span.get_span_context().trace_id
        assert asyncrpc.rpc_sync("t1", fns.size_of, args=(half,)) == 1 << 19
    on_lane = asyncrpc.get_metrics()["lane_calls"] - lane_calls
    with root("sizes_async") as span:  # an async def on t2: the loop's path, both sides
        roots["sizes_async"] = span.get_span_context().trace_id
        big = torch.zeros(1 << 18)  # 1 MiB
        assert asyncrpc.rpc_async("t2", fns.async_size_of, args=(big,)).wait() == 1 << 20
    with root("backward") as span:
        roots["backward"] = span.get_span_context().trace_id
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("t2", fns.double, args=(x,))
            dist_autograd.backward(context_id, [y.sum()])
            assert dist_autograd.get_gradients(context_id)[x].tolist() == [2.0, 2.0, 2.0]
    return roots, on_lane


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--no-provider", action="store_true")
    args = parser.parse_args()
    if not args.no_provider:
        record_spans()
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=30.0, shared_memory=False
    )
    asyncrpc.init_rpc(f"t{args.rank}", rank=args.rank, world_size=args.world_size,
                      rpc_backend_options=options)  # fmt: skip
    try:
        if args.rank == 0:
            roots, on_lane = scenario()
            spans = [
                span
                for r in range(args.world_size)
                for span in asyncrpc.rpc_sync(f"t{r}", recorded_spans)
            ]
            gathered = {"roots": roots, "spans": spans, "on_lane": on_lane}
            print("SPANS " + json.dumps(gathered), flush=True)
    finally:
        asyncrpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
