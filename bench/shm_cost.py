"""Shared memory on and off: tensor echo between two workers on this host, and a no-op call.

    python bench/shm_cost.py [--sizes 256KiB,1MiB,16MiB,64MiB] [--echoes 20] [--rounds 3]

Each round starts a fresh pair of workers (this process and one server on 127.0.0.1, which
reach each other over a Unix socket) per mode, ``shared_memory`` off and on alternating.
Prints the echo bandwidth (2 x bytes / median round trip, MB = 10^6 B) and the p50 of a
no-op ``rpc_sync``, with on/off ratios (medians over rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import asyncrpc
from asyncrpc.bench import workloads as fns
from asyncrpc.testing import free_port, spawn_worker, stop_workers

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def parse_size(text: str) -> int:
    return int(text[:-3]) * _UNITS[text[-3:]]


def measure(shared: bool, sizes: list[int], echoes: int, log_dir: Path) -> dict[str, float]:
    init = f"tcp://127.0.0.1:{free_port()}"
    flag = ["--shared-memory", str(int(shared))]
    server = spawn_worker("server", 1, 2, init, log_dir=log_dir, extra_args=flag)
    options = asyncrpc.RpcBackendOptions(init_method=init, rpc_timeout=120.0)
    options.shared_memory = shared
    out: dict[str, float] = {}
    try:
        asyncrpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=options)
        samples = []
        for _ in range(2000):
            started = time.perf_counter()
            asyncrpc.rpc_sync("server", fns.noop)
            samples.append(time.perf_counter() - started)
        out["noop_p50_us"] = statistics.median(samples[200:]) * 1e6
        for size in sizes:
            tensor = torch.ones(size // 4)
            for _ in range(3):  # warm-up: connection, probe, chunks of this size
                asyncrpc.rpc_sync("server", fns.echo, args=(tensor,))
            times = []
            for _ in range(echoes):
                started = time.perf_counter()
                asyncrpc.rpc_sync("server", fns.echo, args=(tensor,))
                times.append(time.perf_counter() - started)
            out[f"echo_{size}"] = 2 * size / statistics.median(times) / 1e6
        out["shm_segments"] = asyncrpc.get_metrics()["shm_segments_sent"]
        asyncrpc.shutdown()
    finally:
        stop_workers([server], timeout=30)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="256KiB,1MiB,16MiB,64MiB")
    parser.add_argument("--echoes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for shared in (False, True):
                runs[shared].append(measure(shared, sizes, args.echoes, Path(tmp)))
    keys = ["noop_p50_us", *(f"echo_{s}" for s in sizes)]
    print(f"{'':22} {'socket':>10} {'shared':>10} {'shared/socket':>14}")
    for key in keys:
        off = statistics.median(r[key] for r in runs[False])
        on = statistics.median(r[key] for r in runs[True])
        label = key if key.startswith("noop") else f"echo {key[5:]} B, MB/s"
        print(f"{label:22} {off:10.1f} {on:10.1f} {on / off:13.2f}x")
    segments = [r["shm_segments"] for r in runs[True]]
    print(f"segments through shared memory per 'shared' round: {segments}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
