"""``python -m tests.integration.absent_job``: a worker of a 2-worker group in a process
where ``opentelemetry`` and ``prometheus_client`` cannot be imported, as without the
optional extras. Rank 0 makes a call of each kind and prints ``OK`` when all worked."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

HIDDEN = ("opentelemetry", "prometheus_client")


class _Hidden(importlib.abc.MetaPathFinder):
    """Finds the hidden packages first, and fails them as if not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".", maxsplit=1)[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


sys.meta_path.insert(0, _Hidden())

import argparse  # noqa: E402
import operator  # noqa: E402

import asyncrpc  # noqa: E402
import asyncrpc.metrics  # noqa: E402  (imports without prometheus_client: serve() needs it)
from asyncrpc.observe.features import features, tracing_available  # noqa: E402
from tests.integration import stream_fns  # noqa: E402


def calls() -> None:
    assert asyncrpc.rpc_sync("b1", operator.add, args=(1, 2)) == 3
    assert asyncrpc.rpc_async("b1", operator.mul, args=(2, 3)).wait() == 6
    assert asyncrpc.remote("b1", operator.add, args=(2, 2)).to_here() == 4
    assert list(asyncrpc.stream("b1", stream_fns.count, 3)) == [0, 1, 2]
    assert not tracing_available()
    assert [type(f).__name__ for f in features()] == ["CallFigures"]
    try:
        asyncrpc.metrics.serve(0)
    except ImportError:
        pass
    else:
        raise AssertionError("serve() without prometheus_client")
    assert asyncrpc.get_debug_info()["calls_sent"] >= 4
    leaked = [m for m in sys.modules if m.split(".")[0] in HIDDEN]
    assert not leaked, leaked


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    args = parser.parse_args()
    options = asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=30.0)
    asyncrpc.init_rpc(f"b{args.rank}", rank=args.rank, world_size=2, rpc_backend_options=options)
    try:
        if args.rank == 0:
            calls()
            print("OK", flush=True)
    finally:
        asyncrpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
