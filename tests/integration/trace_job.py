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
from tests.integration import trace_fns as fns


def scenario() -> dict[str, int]:
    """Each user span's trace id, by what it covers."""
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
    with root("backward") as span:
        roots["backward"] = span.get_span_context().trace_id
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("t2", fns.double, args=(x,))
            dist_autograd.backward(context_id, [y.sum()])
            assert dist_autograd.get_gradients(context_id)[x].tolist() == [2.0, 2.0, 2.0]
    return roots


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--no-provider", action="store_true")
    args = parser.parse_args()
    if not args.no_provider:
        fns.install()
    options = asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=30.0)
    asyncrpc.init_rpc(f"t{args.rank}", rank=args.rank, world_size=args.world_size,
                      rpc_backend_options=options)  # fmt: skip
    try:
        if args.rank == 0:
            roots = scenario()
            spans = [
                span
                for r in range(args.world_size)
                for span in asyncrpc.rpc_sync(f"t{r}", fns.finished_spans)
            ]
            print("SPANS " + json.dumps({"roots": roots, "spans": spans}), flush=True)
    finally:
        asyncrpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
