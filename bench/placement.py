"""Where the scheduler puts a pair's threads, and what that does to a small call.

    python bench/placement.py [ROUNDS] [--systems torch,asyncrpc]

For each library, one long-lived pair of plain processes (``w0`` calls ``rpc_sync(w1,
noop)``, as ``asyncrpc.bench.plain`` does) is measured again and again while the threads of
both processes are moved with ``sched_setaffinity`` (``taskset -a``): ``free`` (both CPUs,
as nobody pins), ``same`` (everything on CPU 0) and ``split`` (w0 on CPU 0, w1 on CPU 1),
in turn, ROUNDS times. Each measurement is the p50 of 1,500 calls after 250 untimed ones.
Same code, same processes: the difference between the rows is placement alone. It is why
one start of a system cannot stand for a whole benchmark run (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from importlib import import_module

_MODULES = {"torch": "torch.distributed.rpc", "asyncrpc": "asyncrpc"}
PLACEMENTS = {"free": ("0,1", "0,1"), "same": ("0", "0"), "split": ("0", "1")}
CALLS, WARMUP = 1500, 250


def noop() -> None:
    """Nothing (pickled by reference as ``__main__.noop``: both ends run this file)."""


def _worker(module: str, rank: int, port: int) -> None:
    # Rank 0 measures on each line it reads and prints the p50 in µs; rank 1 only serves.
    rpc = import_module(module)
    import torch.distributed.rpc as torch_rpc

    options = torch_rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            for _ in range(WARMUP):
                rpc.rpc_sync("w1", noop)
            samples = []
            for _ in range(CALLS):
                t0 = time.perf_counter()
                rpc.rpc_sync("w1", noop)
                samples.append(time.perf_counter() - t0)
            print(statistics.median(samples) * 1e6, flush=True)
    rpc.shutdown()


class _Pair:
    """The two processes of one library, started here and always stopped by ``close``."""

    def __init__(self, system: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        argv = [sys.executable, "-P", __file__, "--worker", _MODULES[system]]
        self.procs = [
            subprocess.Popen(
                [*argv, str(rank), str(port)], env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
            for rank in range(2)
        ]  # fmt: skip
        if self._line(120) != "ready":
            raise RuntimeError(f"the {system} pair did not start")

    def _line(self, timeout: float) -> str:
        # Bounded: the pair answers within seconds; a dead one ends the whole script.
        out = self.procs[0].stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = out.readline()
            if line or self.procs[0].poll() is not None:
                return line.strip()
        raise RuntimeError("no answer from the measuring process")

    def place(self, cpus: tuple[str, str]) -> None:
        for proc, cpu_list in zip(self.procs, cpus, strict=True):
            subprocess.run(
                ["taskset", "-a", "-p", "-c", cpu_list, str(proc.pid)],
                stdout=subprocess.DEVNULL, check=True,
            )  # fmt: skip

    def measure(self) -> float:
        stdin = self.procs[0].stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()
        return float(self._line(120))

    def close(self) -> None:
        stdin = self.procs[0].stdin
        if stdin is not None and self.procs[0].poll() is None:
            stdin.write("quit\n")
            stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _run(system: str, rounds: int) -> dict[str, list[float]]:
    pair = _Pair(system)
    got: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    try:
        for _ in range(rounds):
            for name, cpus in PLACEMENTS.items():
                pair.place(cpus)
                got[name].append(pair.measure())
    finally:
        pair.close()
    return got


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        os._exit(0)  # skip tearing down an interpreter that imported torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", type=int, nargs="?", default=6)
    parser.add_argument("--systems", default="torch,asyncrpc")
    args = parser.parse_args()
    print(f"{'p50 µs of rpc_sync(noop)':26} {'free':>6} {'same':>6} {'split':>6}   (each round)")
    for system in args.systems.split(","):
        got = _run(system, args.rounds)
        medians = "".join(f" {statistics.median(v):6.0f}" for v in got.values())
        rounds = "; ".join(f"{k} {', '.join(f'{x:.0f}' for x in v)}" for k, v in got.items())
        print(f"{system:26}{medians}   ({rounds})")


if __name__ == "__main__":
    main()
