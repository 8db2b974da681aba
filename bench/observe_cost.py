"""CPU per call with tracing and metrics off and on, against the tree before them.

    python bench/observe_cost.py [--rounds 3] [--calls 3000] [--today PATH]

Each round starts a fresh caller/callee pair per variant, in turn (variants interleaved,
so a slow minute of a shared VM hits them all), and measures the CPU both processes spend
per call (``/proc/<pid>/task/*/schedstat``, every thread) over ``--calls`` calls of
``operator.add``, ``rpc_sync`` (a lane) and ``rpc_async`` (the loop's path). Variants:

- today: the tree ``--today`` names (a checkout of the commit before; skipped without);
- hidden: this tree, opentelemetry and prometheus_client not importable;
- off: this tree, both installed, no tracer provider, no metrics served;
- metrics: ``asyncrpc.metrics.serve(0)`` on both (per-call figures counted);
- tracing: an SDK tracer provider on both, spans to an exporter that drops them.

Wall times on a shared VM move 2-4x; CPU per call far less: it is what the table shows,
median of the rounds, in microseconds.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import operator
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

VARIANTS = ("today", "hidden", "off", "metrics", "tracing")
HERE = Path(__file__).resolve().parents[1]


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".", maxsplit=1)[0] in ("opentelemetry", "prometheus_client"):
            raise ModuleNotFoundError(name)
        return None


def cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def _tracing() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Dropping()))
    trace.set_tracer_provider(provider)


def _measure(calls: int) -> dict[str, float]:
    import asyncrpc

    callee = asyncrpc.rpc_sync("callee", os.getpid)
    me = os.getpid()
    result = {}
    for how in ("sync", "async"):

        def one(how: str = how) -> object:
            if how == "sync":
                return asyncrpc.rpc_sync("callee", operator.add, args=(1, 1))
            return asyncrpc.rpc_async("callee", operator.add, args=(1, 1)).wait()

        for _ in range(300):
            one()
        mine, theirs = cpu_ns(me), cpu_ns(callee)
        for _ in range(calls):
            one()
        result[f"{how}_caller_us"] = (cpu_ns(me) - mine) / calls / 1000
        result[f"{how}_callee_us"] = (cpu_ns(callee) - theirs) / calls / 1000
    return result


def child(variant: str, rank: int, init: str, calls: int) -> None:
    if variant == "hidden":
        sys.meta_path.insert(0, _Hidden())
    if variant == "tracing":
        _tracing()
    import asyncrpc

    server = None
    if variant == "metrics":
        import asyncrpc.metrics

        server = asyncrpc.metrics.serve(0)
    options = asyncrpc.RpcBackendOptions(init_method=init, rpc_timeout=60.0)
    name = "caller" if rank == 0 else "callee"
    asyncrpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            print("RESULT " + json.dumps(_measure(calls)), flush=True)
    finally:
        asyncrpc.shutdown()
        if server is not None:
            server.close()


def _run(variant: str, calls: int, today: Path | None) -> dict[str, float] | None:
    from asyncrpc.testing import free_port

    root = today if variant == "today" else HERE
    if root is None:
        return None
    env = {**os.environ, "PYTHONPATH": str(root)}
    init = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--init", init,
           "--calls", str(calls)]  # fmt: skip
    # The script runs from its own file; the tree under test is the one on PYTHONPATH.
    callee = subprocess.Popen([*cmd, "--rank", "1"], env=env, cwd=root)
    try:
        out = subprocess.run([*cmd, "--rank", "0"], env=env, cwd=root, capture_output=True,
                             text=True, timeout=300, check=True).stdout  # fmt: skip
        callee.wait(60)
    finally:
        if callee.poll() is None:
            callee.kill()
            callee.wait(10)
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    result: dict[str, float] = json.loads(line[len("RESULT ") :])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--today", type=Path, default=None, help="the tree before (asyncrpc/)")
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--init")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rank, args.init, args.calls)
        return 0
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            result = _run(variant, args.calls, args.today)
            if result is not None:
                rows[variant].append(result)
    keys = ("sync_caller_us", "sync_callee_us", "async_caller_us", "async_callee_us")
    print(f"CPU µs per call, median of {args.rounds} rounds of {args.calls} calls")
    print(f"{'variant':<9}" + "".join(f"{k.removesuffix('_us'):>16}" for k in keys))
    for variant, results in rows.items():
        if results:
            cells = "".join(f"{statistics.median(r[k] for r in results):>16.1f}" for k in keys)
            print(f"{variant:<9}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
