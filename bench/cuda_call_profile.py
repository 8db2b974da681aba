"""Where a small CUDA call's time goes: CPU per call in each process, and sampled stacks.

Two spawned processes on one GPU (a client calling ``echo`` on a server with a small CUDA
tensor, device maps both ways), as ``make bench-cuda``'s small-tensor row does, but with
the CPU time of each process per call (``time.process_time``: all its threads) and, for
asyncrpc, an in-process stack sampler in each process (a thread reading
``sys._current_frames`` every ``--interval`` seconds: py-spy needs ptrace, which the GPU
machines' sandbox may refuse). On a machine whose processes share one core, CPU per call
is the latency floor, so it is the figure to compare with torch's.

    python bench/cuda_call_profile.py --libraries torch,asyncrpc-auto,asyncrpc-staged
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from asyncrpc.bench.cuda import _free_port, _options, _rpc

_sampler: Sampler | None = None
_cpu_start = 0.0


class Sampler:
    """Counts, per thread, the function each sample finds running (self) and the
    functions on its stack (inclusive), and the stacks' last frames (collapsed)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples = 0
        self.self_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
        self.stacks: collections.Counter[tuple[str, str]] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):  # bounded by stop()
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = names.get(ident, str(ident))
                stack: list[str] = []
                f: Any = frame
                while f is not None and len(stack) < 80:  # bounded depth
                    code = f.f_code
                    stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    f = f.f_back
                self.self_counts[(thread, stack[0])] += 1
                for name in set(stack):
                    self.inclusive[(thread, name)] += 1
                self.stacks[(thread, ";".join(reversed(stack[:10])))] += 1

    def report(self, top: int) -> str:
        lines = [f"samples: {self.samples} (every {self.interval * 1e6:.0f} us)"]
        threads = sorted({t for t, _ in self.self_counts})
        for thread in threads:
            lines.append(f"-- thread {thread}: self")
            own = [(n, c) for (t, n), c in self.self_counts.items() if t == thread]
            for name, count in sorted(own, key=lambda x: -x[1])[:top]:
                lines.append(f"   {count:6d} {name}")
            lines.append(f"-- thread {thread}: inclusive")
            inc = [(n, c) for (t, n), c in self.inclusive.items() if t == thread]
            for name, count in sorted(inc, key=lambda x: -x[1])[:top]:
                lines.append(f"   {count:6d} {name}")
            lines.append(f"-- thread {thread}: stacks (last 10 frames)")
            st = [(n, c) for (t, n), c in self.stacks.items() if t == thread]
            for name, count in sorted(st, key=lambda x: -x[1])[: top // 2]:
                lines.append(f"   {count:6d} {name}")
        return "\n".join(lines)


class SeamTimes:
    """Wall and thread-CPU time of each ``CudaDevices`` method, summed per method: a
    method whose wall time is far above its CPU time was waiting (the GIL, a driver
    lock), not working."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        self._lock = threading.Lock()

    def install(self) -> None:
        from asyncrpc.runtime.cuda import real

        for name, fn in list(vars(real.CudaDevices).items()):
            if callable(fn) and not name.startswith("__"):
                setattr(real.CudaDevices, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
                with self._lock:
                    entry = self.totals[name]
                    entry[0] += 1
                    entry[1] += wall
                    entry[2] += cpu

        return timed

    def take(self, calls: int) -> str:
        with self._lock:
            rows = sorted(self.totals.items(), key=lambda kv: -kv[1][1])
            self.totals.clear()
        lines = [f"   {'method':24s} {'per call':>8s} {'wall us':>9s} {'cpu us':>9s}  (per RPC)"]
        for name, (count, wall, cpu) in rows:
            per = [count / calls, wall / calls * 1e6, cpu / calls * 1e6]
            lines.append(f"   {name:24s} {per[0]:8.2f} {per[1]:9.1f} {per[2]:9.1f}")
        return "\n".join(lines)


_seam = SeamTimes()
if os.environ.get("SEAM_TIMES") == "1":
    _seam.install()


def echo(x: Any) -> Any:
    return x


def seam_times(calls: int) -> str:
    return _seam.take(calls)


def sampling(on: bool, interval: float, top: int) -> tuple[float, str]:
    """Runs on the server: start sampling (and its CPU clock), or stop and report."""
    global _sampler, _cpu_start
    if on:
        _cpu_start = time.process_time()
        if interval > 0:
            _sampler = Sampler(interval)
            _sampler.start()
        return 0.0, ""
    cpu = time.process_time() - _cpu_start
    report = ""
    if _sampler is not None:
        _sampler.stop()
        report = _sampler.report(top)
        _sampler = None
    return cpu, report


def _options_for(library: str, port: int, peer: str, device: str, lanes: int | None) -> Any:
    options = _options(library, port, peer, device)
    if lanes is not None and library != "torch":
        options.sync_lanes = lanes
    return options


def _server(library: str, port: int, device: str, lanes: int | None) -> None:
    rpc = _rpc(library)
    options = _options_for(library, port, "client", device, lanes)
    rpc.init_rpc("server", rank=1, world_size=2, rpc_backend_options=options)
    rpc.shutdown()


def _client(library: str, port: int, args: argparse.Namespace, out: Any) -> None:
    rpc = _rpc(library)
    options = _options_for(library, port, "server", args.device, args.sync_lanes)
    rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=options)
    lines = []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    try:
        x = torch.ones(args.numel, device=args.device)
        for _ in range(200):  # warm: probes, blocks, pools
            rpc.rpc_sync("server", echo, args=(x,))
        sync()
        sample = args.interval if library != "torch" else 0.0
        for label, interval in (("plain", 0.0), ("sampled", sample)):
            if label == "sampled" and interval <= 0:
                continue
            rpc.rpc_sync("server", sampling, args=(True, interval, args.top))
            rpc.rpc_sync("server", seam_times, args=(1,))  # from here on
            _seam.take(1)
            sampler = Sampler(interval) if interval > 0 else None
            if sampler:
                sampler.start()
            cpu0, times = time.process_time(), []
            for _ in range(args.calls):  # bounded by --calls
                start = time.perf_counter()
                y = rpc.rpc_sync("server", echo, args=(x,))
                y.sum()  # a use of the reply on this thread's stream, as a user does
                times.append(time.perf_counter() - start)
            sync()
            cpu = time.process_time() - cpu0
            if sampler:
                sampler.stop()
            server_cpu, server_report = rpc.rpc_sync(
                "server", sampling, args=(False, interval, args.top)
            )
            lines.append(
                f"{library} [{label}]: p50 {statistics.median(times) * 1e6:.0f} us, "
                f"p90 {sorted(times)[int(0.9 * len(times))] * 1e6:.0f} us; CPU per call: "
                f"client {cpu / args.calls * 1e6:.0f} us, server "
                f"{server_cpu / args.calls * 1e6:.0f} us"
            )
            if label == "plain" and os.environ.get("SEAM_TIMES") == "1":
                lines.append(f"== {library} client seam\n{_seam.take(args.calls)}")
                server_seam = rpc.rpc_sync("server", seam_times, args=(args.calls,))
                lines.append(f"== {library} server seam\n{server_seam}")
            if sampler:
                lines.append(f"== {library} client sampled\n{sampler.report(args.top)}")
                lines.append(f"== {library} server sampled\n{server_report}")
    finally:
        rpc.shutdown()
    out.put("\n".join(lines))


def run(library: str, args: argparse.Namespace) -> str:
    ctx = mp.get_context("spawn")
    port = _free_port()
    out = ctx.Queue()
    server = ctx.Process(target=_server, args=(library, port, args.device, args.sync_lanes))
    client = ctx.Process(target=_client, args=(library, port, args, out))
    server.start()
    client.start()
    try:
        return str(out.get(timeout=args.timeout))
    finally:
        for process in (client, server):
            process.join(30)
            if process.is_alive():
                process.kill()  # ours, by PID


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", default="torch,asyncrpc-auto")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.0005)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--device", default="cuda", help="cpu: the same calls, no GPU")
    parser.add_argument("--sync-lanes", type=int, default=None, help="asyncrpc's sync_lanes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_call_profile: skipped, no CUDA device here")
        return 0
    for library in args.libraries.split(","):
        try:
            print(run(library, args), flush=True)
        except Exception as exc:  # one library's failure must not hide the others' rows
            print(f"{library}: failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
