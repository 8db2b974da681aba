"""A worker of the ``asyncrpc.top`` tests: serves /metrics, calls its peers, streams.

``python -m tests.integration.top_worker NAME RANK WORLD INIT_METHOD``. Ranks 0 and 1
serve their metrics before they join the group (published in the store as they join),
ranks 2 and 3 after (published at once); each prints ``METRICS <port>``. Every worker
calls every other in turn (so every pair has a connection, and heartbeats to find a
stopped one); rank 0 also consumes a slow endless stream from rank 1. It shuts down when
its stdin closes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

import asyncrpc
import asyncrpc.metrics


def ticks() -> Iterator[int]:
    """An endless stream, one item every 20 ms."""
    n = 0
    while True:
        yield n
        n += 1
        time.sleep(0.02)


def _add(a: int, b: int) -> int:
    return a + b


def _calls(peers: list[str], stop: threading.Event) -> None:
    lost: set[str] = set()
    while not stop.is_set():
        for peer in peers:
            if peer in lost or stop.is_set():
                continue
            try:
                asyncrpc.rpc_sync(peer, _add, args=(1, 2), timeout=10.0)
            except Exception:  # a stopped peer: lost once the heartbeats say so
                lost.add(peer)
        time.sleep(0.01)


def _stream(stop: threading.Event) -> None:
    # Again when one ends (a served request's deadline ends its stream), until stopped.
    while not stop.is_set():
        with contextlib.suppress(Exception):
            for _ in asyncrpc.rpc_stream("t1", ticks, timeout=0):
                if stop.is_set():
                    return
        stop.wait(0.5)


def main() -> int:
    name, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    options = asyncrpc.RpcBackendOptions(init_method=init, rpc_timeout=10.0, shutdown_timeout=5.0)
    if rank < 2:
        server = asyncrpc.metrics.serve(0)
    asyncrpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank >= 2:
        server = asyncrpc.metrics.serve(0)
    print(f"METRICS {server.port}", flush=True)
    stop = threading.Event()
    peers = [f"t{r}" for r in range(world) if r != rank]
    threads = [threading.Thread(target=_calls, args=(peers, stop), daemon=True)]
    if rank == 0:
        threads.append(threading.Thread(target=_stream, args=(stop,), daemon=True))
    for thread in threads:
        thread.start()
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes it
    stop.set()
    for thread in threads:
        thread.join(10.0)
    with contextlib.suppress(Exception):
        asyncrpc.shutdown()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
