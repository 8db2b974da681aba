"""Profile asyncrpc's small-call path: a server and a client process on 127.0.0.1.

The client calls a no-op on the server for ``--seconds`` (``await asyncrpc.call`` or
``rpc_sync``, 1 or more calls in flight) while both processes are sampled with py-spy (all
threads; ``--native`` adds C frames) or profiled with cProfile (the loop thread only, for
call counts). Outputs go to ``--out``: ``{server,client}.txt`` (collapsed stacks, or pstats
text), and a summary of the hottest functions per process on stdout.

    .venv/bin/python -m pip install py-spy
    .venv/bin/python bench/profile_small_calls.py --fn sync --style await --seconds 10
    .venv/bin/python bench/profile_small_calls.py --fn async --profiler cprofile
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from pathlib import Path

import asyncrpc
from asyncrpc.bench import measure, workloads
from asyncrpc.bench.config import Item
from asyncrpc.runtime.threads.loopthread import new_event_loop
from asyncrpc.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
_START = "profiling-starts-now"


def _patch_default_write_limits() -> None:
    # Experiment: keep the transport's default high-water mark instead of high=0. Only
    # valid for calls without tensors (zero-copy keepalive is no longer tracked).
    from asyncrpc.runtime.net import transport

    made = transport.Connection.connection_made

    def connection_made(self: transport.Connection, tp: asyncio.BaseTransport) -> None:
        made(self, tp)
        tp.set_write_buffer_limits()  # type: ignore[attr-defined]

    transport.Connection.connection_made = connection_made  # type: ignore[method-assign]


EXPERIMENTS = ("write-limits", "no-timeout", "switch-0.1ms")


def _apply_experiments(names: list[str]) -> None:
    if "write-limits" in names:
        _patch_default_write_limits()
    if "switch-0.1ms" in names:
        sys.setswitchinterval(0.0001)


async def _role_main(args: argparse.Namespace) -> None:
    _apply_experiments(args.experiment)
    rank = 0 if args.role == "server" else 1
    timeout = 0.0 if "no-timeout" in args.experiment else 60.0
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, shutdown_timeout=300, rpc_timeout=timeout
    )
    await asyncrpc.init_rpc_async(args.role, rank=rank, world_size=2, rpc_backend_options=options)
    if args.role == "client":
        await _client(args)
    await asyncrpc.shutdown_async()


async def _client(args: argparse.Namespace) -> None:
    kind = "latency" if args.inflight == 1 else "throughput"
    style = "futures" if args.style == "sync" and kind == "throughput" else args.style
    item = Item("p", kind, args.fn, style, args.inflight)
    await measure.run_item_await(item, "server", 1.0, {})  # warm-up, not profiled
    profile = cProfile.Profile() if args.profiler == "cprofile" else None
    if profile is not None:
        profile.enable()
    print(_START, flush=True)  # the orchestrator attaches py-spy now
    # Run a little longer than py-spy samples, so it never sees the shutdown.
    stats = await measure.run_item_await(item, "server", args.seconds + 1.5, {})
    if profile is not None:
        profile.disable()
        profile.dump_stats(Path(args.out) / "client.pstats")
    label = f"{args.fn} no-op, {style}, {args.inflight} in flight"
    print(f"client: {label}: {json.dumps(stats)}", flush=True)


def _run_role(args: argparse.Namespace) -> int:
    loop = new_event_loop()
    profile = None
    if args.profiler == "cprofile" and args.role == "server":
        profile = cProfile.Profile()
        profile.enable()
    try:
        loop.run_until_complete(_role_main(args))
    finally:
        loop.close()
        if profile is not None:
            profile.disable()
            profile.dump_stats(Path(args.out) / "server.pstats")
    return 0


def _spawn(args: argparse.Namespace, role: str, init: str) -> subprocess.Popen[str]:
    me = [sys.executable, __file__, "--role", role, "--init-method", init, "--fn", args.fn,
          "--style", args.style, "--inflight", str(args.inflight), "--seconds",
          str(args.seconds), "--profiler", args.profiler, "--out", args.out,
          *(f"--experiment={e}" for e in args.experiment)]  # fmt: skip
    return subprocess.Popen(me, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _attach_py_spy(args: argparse.Namespace, pids: dict[str, int]) -> list[subprocess.Popen[str]]:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    flags = ["--rate", str(args.rate), "--format", "raw", "--duration", str(int(args.seconds))]
    # --native must pause the process to unwind C stacks; otherwise sample without pausing.
    flags += ["--native"] if args.native else ["--nonblocking"]
    flags += ["--gil"] if args.gil else []
    return [
        subprocess.Popen(
            [spy, "record", *flags, "--pid", str(pid), "-o", str(Path(args.out) / f"{role}.txt")],
            cwd=ROOT,
        )
        for role, pid in pids.items()
    ]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _print_cpu_per_call(line: str, cpu0: list[float], cpu1: list[float]) -> None:
    calls = int(json.loads(line.split(": ", 2)[2])["n"])
    server_us, client_us = ((b - a) / calls * 1e6 for a, b in zip(cpu0, cpu1, strict=True))
    print(f"CPU per call: server {server_us:.1f} µs, client {client_us:.1f} µs "
          f"({calls} calls; includes profiler overhead if one ran)")  # fmt: skip


def _summarize_collapsed(path: Path, top: int) -> None:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].split("/")[-1]
                  for f in stack.split(";") if f]  # fmt: skip
        n = int(count)
        total += n
        if frames:
            self_n[frames[-1]] += n
        for frame in set(frames):
            incl_n[frame] += n
    print(f"\n== {path.name}: {total} samples (threads not idle)")
    print("   self%  function")
    for frame, n in self_n.most_common(top):
        print(f"  {100 * n / total:6.1f}  {frame}")
    print("   incl%  function")
    for frame, n in incl_n.most_common(top):
        print(f"  {100 * n / total:6.1f}  {frame}")


def _orchestrate(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    server, client = _spawn(args, "server", init), _spawn(args, "client", init)
    procs: list[subprocess.Popen[str]] = [server, client]
    try:
        assert client.stdout is not None
        cpu0: list[float] = []
        for line in client.stdout:
            if line.strip() == _START:
                cpu0 = [_cpu_seconds(server.pid), _cpu_seconds(client.pid)]
                if args.profiler == "py-spy":
                    procs += _attach_py_spy(args, {"server": server.pid, "client": client.pid})
                continue
            if line.startswith("client:") and cpu0:
                cpu1 = [_cpu_seconds(server.pid), _cpu_seconds(client.pid)]
                _print_cpu_per_call(line, cpu0, cpu1)
            print(line, end="")
        deadline = time.monotonic() + args.seconds + 120
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, 9)
                proc.wait()
    for role in ("server", "client"):
        collapsed, stats = Path(args.out) / f"{role}.txt", Path(args.out) / f"{role}.pstats"
        if collapsed.exists():
            _summarize_collapsed(collapsed, args.top)
        if stats.exists():
            print(f"\n== {stats.name} (cProfile, loop thread)")
            pstats.Stats(str(stats)).sort_stats("tottime").print_stats(args.top)
    return max(codes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    p.add_argument("--fn", choices=("sync", "inline", "async", "builtin"), default="sync")
    p.add_argument("--style", choices=("await", "sync"), default="await")
    p.add_argument("--inflight", type=int, default=1)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--profiler", choices=("py-spy", "cprofile", "none"), default="py-spy")
    p.add_argument("--native", action="store_true", help="py-spy: include C frames")
    p.add_argument("--gil", action="store_true", help="py-spy: only the thread holding the GIL")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--experiment",
        action="append",
        default=[],
        choices=EXPERIMENTS,
        help="patch both processes to estimate an optimisation's gain (repeatable)",
    )
    p.add_argument("--out", default="bench/profiles")
    args = p.parse_args()
    _ = workloads  # the server must import the benchmark's functions
    return _run_role(args) if args.role else _orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
