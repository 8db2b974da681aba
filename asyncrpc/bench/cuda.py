"""CUDA bench: asyncrpc against torch.distributed.rpc, the same script for both, two
processes on one GPU with device maps {0: 0} both ways.

    python -m asyncrpc.bench --workloads cuda      # both libraries, every row (make bench-cuda)
    python -m asyncrpc.bench.cuda --device cpu     # the same rows on CPU tensors (no GPU)
    python -m asyncrpc.bench.cuda --transfers ipc,staged,host   # asyncrpc once per transfer

Rows: echo (there and back) of 1-256 MiB, a small tensor's p50, how long ``rpc_async``
takes to return while the GPU is busy with a long kernel writing its argument, and the
p99 of no-op calls from another thread meanwhile. asyncrpc runs once per CUDA transfer
(``cuda_transfer``: "ipc" by handle, "staged" through pinned memory, "auto", "host"; a
column each). Each library runs in a fresh pair of
processes; the figures are medians over ``--repeats`` runs. Wall times on a shared
machine move; compare the two libraries' columns of one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import threading
import time
from typing import Any

import torch

MIB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
BUSY_CYCLES = 400_000_000  # torch.cuda._sleep: a few hundred ms of GPU time


def echo(x: Any) -> Any:
    return x


def noop() -> None:
    return None


def _rpc(library: str) -> Any:
    """torch's rpc for "torch"; asyncrpc for "asyncrpc" or "asyncrpc-<transfer>"."""
    if library == "torch":
        from torch.distributed import rpc

        return rpc
    import asyncrpc

    return asyncrpc


def _options(library: str, port: int, peer: str, device: str) -> Any:
    rpc = _rpc(library)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    transfer = library.partition("-")[2]
    if transfer:
        options.cuda_transfer = transfer
    if device == "cuda":
        options.set_device_map(peer, {0: 0})
    return options


def _server(library: str, port: int, device: str) -> None:
    rpc = _rpc(library)
    rpc.init_rpc("server", rank=1, world_size=2,
                 rpc_backend_options=_options(library, port, "client", device))  # fmt: skip
    rpc.shutdown()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, repeats: int, device: str) -> list[float]:
    times = []
    for _ in range(repeats):  # bounded by --repeats
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _client(library: str, port: int, device: str, repeats: int, out: Any) -> None:
    rpc = _rpc(library)
    rpc.init_rpc("client", rank=0, world_size=2,
                 rpc_backend_options=_options(library, port, "server", device))  # fmt: skip
    rows: dict[str, float] = {}
    try:
        for size in SIZES_MIB:
            x = torch.ones(size * MIB // 4, device=device)
            rpc.rpc_sync("server", echo, args=(x,))  # warm
            times = _timed(lambda x=x: rpc.rpc_sync("server", echo, args=(x,)), repeats, device)
            rows[f"echo {size} MiB (ms)"] = statistics.median(times) * 1e3
        small = torch.ones(256, device=device)
        times = _timed(lambda: rpc.rpc_sync("server", echo, args=(small,)), 50 * repeats, device)
        rows["small tensor p50 (us)"] = statistics.median(times) * 1e6
        if device == "cuda":
            rows.update(_busy_gpu(rpc, repeats))
    finally:
        rpc.shutdown()
    out.put(rows)


def _busy_gpu(rpc: Any, repeats: int) -> dict[str, float]:
    """rpc_async's return time behind a long kernel, and no-op p99 from another thread."""
    returns, noop_times = [], []
    stop = threading.Event()

    def noops(count: int) -> None:
        for _ in range(count):  # bounded; stopped by the main thread
            if stop.is_set():
                return
            noop_times.append(_noop_time(rpc))

    # The same calls from another thread with the GPU idle, the yardstick for "meanwhile".
    idle = threading.Thread(target=noops, args=(300,))
    idle.start()
    idle.join(120)
    idle_p99 = _p99(noop_times)
    noop_times.clear()
    thread = threading.Thread(target=noops, args=(100_000,))
    thread.start()
    try:
        for _ in range(repeats):
            x = torch.zeros(16 * MIB // 4, device="cuda")
            torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]
            x.fill_(1.0)
            start = time.perf_counter()
            fut = rpc.rpc_async("server", echo, args=(x,))
            returns.append(time.perf_counter() - start)
            fut.wait()
            torch.cuda.synchronize()
    finally:
        stop.set()
        thread.join(60)
    return {
        "rpc_async return behind busy GPU (ms)": statistics.median(returns) * 1e3,
        "no-op p99, GPU idle (us)": idle_p99 * 1e6,
        "no-op p99 meanwhile (us)": _p99(noop_times) * 1e6,
        # One stall of the whole process (a step holding the GIL while the GPU works)
        # hides under the p99 of hundreds of calls: the longest call shows it.
        "no-op max meanwhile (us)": max(noop_times, default=float("nan")) * 1e6,
    }


def _noop_time(rpc: Any) -> float:
    start = time.perf_counter()
    rpc.rpc_sync("server", noop)
    return time.perf_counter() - start


def _p99(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[int(0.99 * (len(ordered) - 1))] if ordered else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(library: str, device: str, repeats: int, timeout: float = 900) -> dict[str, float]:
    """One library's rows from a fresh pair of processes; queue.Empty after ``timeout`` s."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    out = ctx.Queue()
    server = ctx.Process(target=_server, args=(library, port, device))
    client = ctx.Process(target=_client, args=(library, port, device, repeats, out))
    server.start()
    client.start()
    try:
        rows: dict[str, float] = out.get(timeout=timeout)
    finally:
        for process in (client, server):
            process.join(60)
            if process.is_alive():
                process.kill()  # ours, by PID
    return rows


SKIPPED = "cuda: skipped, no CUDA device here (torch.cuda.is_available() is False)"


def main(argv: list[str] | None = None) -> int:
    """Run the CUDA rows (or say they were skipped); 0 either way, 2 on bad options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--timeout", type=float, default=900,
        help="seconds one library's run may take; past it that column reads 'failed'",
    )  # fmt: skip
    parser.add_argument(
        "--transfers", default="ipc,staged",
        help="asyncrpc's cuda_transfer values to run, comma-separated (auto, ipc, staged, host)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{SKIPPED}; python -m asyncrpc.bench.cuda --device cpu runs the harness")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ours = [f"asyncrpc-{t}" for t in args.transfers.split(",") if t]
    results: dict[str, dict[str, float]] = {}
    for lib in ("torch", *ours):
        try:
            results[lib] = run(lib, args.device, args.repeats, args.timeout)
        except queue.Empty:
            print(f"{lib}: failed, no figures within {args.timeout:g} s", flush=True)
            results[lib] = {}
            continue
        # One line per library as it finishes, so a run cut short still tells something.
        print(f"{lib}: {json.dumps(results[lib])}", flush=True)
    rows = next((r for r in results.values() if r), {})
    print(f"{'row':44} {'torch':>10}" + "".join(f" {lib[9:]:>10} {'ratio':>7}" for lib in ours))
    for row in rows:
        theirs = results["torch"].get(row, float("nan"))
        line = f"{row:44} {theirs:10.2f}"
        for lib in ours:
            mine = results[lib].get(row, float("nan"))
            line += f" {mine:10.2f} {theirs / mine:6.2f}x" if mine else f" {'failed':>10} {'':>7}"
        print(line)
    print("columns: asyncrpc per cuda_transfer; ratio: torch's figure / asyncrpc's (above 1:")
    print("asyncrpc is faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
