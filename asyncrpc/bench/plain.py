"""The ``plain`` workload: a user's own timing program, run with torch and with asyncrpc.

Part of ``asyncrpc.bench``. Nothing of the harness runs in or between the timed calls: the
launcher starts two fresh processes, each runs this file as a script (by path, with ``-P``,
so that the torch run never imports asyncrpc), both call ``init_rpc``, rank 0 times each
call with ``time.perf_counter`` in a plain loop, writes its figures to a JSON file, and both
call ``shutdown``. The same code drives both libraries (``import ... as rpc``), as a user
porting by imports would run it. The harness's rows are checked against these.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["PlainError", "run_plain"]

_MODULES = {"torch": "torch.distributed.rpc", "asyncrpc": "asyncrpc"}
_PEER = "w1"


class PlainError(Exception):
    """The plain program failed or did not finish in time."""


# -- what the user's program calls ----------------------------------------------------------


class Layer(torch.nn.Module):
    """The remote layer of the model rows: Linear(64, 64) and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x))
        return out


def noop() -> None:
    """Nothing."""


def value() -> int:
    """A small value for ``remote()`` + ``to_here()``."""
    return 42


def times2(x: torch.Tensor) -> torch.Tensor:
    """``x * 2``."""
    return x * 2


def forward(rref: Any, x: torch.Tensor) -> torch.Tensor:
    """The owner's layer behind ``rref`` applied to ``x``."""
    out: torch.Tensor = rref.local_value()(x)
    return out


def param_rrefs(rref: Any, module: str) -> list[Any]:
    """RRefs of the parameters of the layer behind ``rref``, made by ``module``'s RRef."""
    rpc = sys.modules[module]
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


# -- the timing loop ------------------------------------------------------------------------


def _cpu_ns(pid: int) -> int:
    # Nanoseconds on a CPU, all threads (busy-polling ones too). The same reading as
    # asyncrpc.bench.cpu, repeated here so that the torch run never imports asyncrpc.
    # Our own process is read from its CPU clock: schedstat counts a running thread's
    # time only when it is switched out or at a tick, and a thread that polls instead of
    # sleeping can run a short row through without either (0 µs read for 20 calls).
    if pid == os.getpid():
        return time.process_time_ns()
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _timed(fn: Callable[[], object], n: int, pids: dict[str, int]) -> dict[str, float]:
    """Warm up, then time ``n`` calls of ``fn`` one by one; CPU read only before and after."""
    for _ in range(max(20, n // 8)):
        fn()
    samples = []
    before = {role: _cpu_ns(pid) for role, pid in pids.items()}
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    after = {role: _cpu_ns(pid) for role, pid in pids.items()}
    stats = _latency(samples)
    for role in pids:
        stats[f"cpu_us_{role}"] = (after[role] - before[role]) / 1e3 / n
    stats["cpu_us_total"] = sum(stats[f"cpu_us_{role}"] for role in pids)
    return stats


def _latency(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    count = len(ordered)
    return {
        "p50_us": ordered[count // 2] * 1e6,
        "p99_us": ordered[min(count - 1, int(count * 0.99))] * 1e6,
        "mean_us": sum(ordered) / count * 1e6,
        "n": count,
    }


def _modules(system: str) -> tuple[Any, Any, Any]:
    name = _MODULES[system]
    if system == "torch":
        names = (name, "torch.distributed.autograd", "torch.distributed.optim")
    else:
        names = (name, f"{name}.autograd", f"{name}.optim")
    rpc, autograd, optim = (importlib.import_module(n) for n in names)
    return rpc, autograd, optim


def _measure(system: str, n: int) -> dict[str, dict[str, float]]:
    """Rank 0's program: every row of ``asyncrpc.bench.config.PLAIN_ROWS``, in order."""
    rpc, ag, optim = _modules(system)
    pids = {"client": os.getpid(), "server": rpc.rpc_sync(_PEER, os.getpid)}
    rref = rpc.remote(_PEER, Layer)
    x = torch.randn(32, 64)
    xg = torch.randn(32, 64, requires_grad=True)
    a, b = torch.ones(2), torch.ones(2)
    local = torch.nn.Linear(64, 64)
    remote_params = rpc.rpc_sync(_PEER, param_rrefs, args=(rref, _MODULES[system]))
    params = [rpc.RRef(p) for p in local.parameters()] + remote_params
    opt = optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.001)
    res: dict[str, dict[str, float]] = {}
    res["noop"] = _timed(lambda: rpc.rpc_sync(_PEER, noop), n, pids)
    res["torch.add"] = _timed(lambda: rpc.rpc_sync(_PEER, torch.add, args=(a, b)), n, pids)
    res["remote"] = _timed(lambda: rpc.remote(_PEER, value).to_here(), n, pids)
    res["x*2 8KiB"] = _timed(lambda: rpc.rpc_sync(_PEER, times2, args=(x,)), n, pids)
    res["fwd(rref,x)"] = _timed(lambda: rpc.rpc_sync(_PEER, forward, args=(rref, x)), n, pids)

    def ctx_fwd() -> None:
        with ag.context():
            rpc.rpc_sync(_PEER, forward, args=(rref, xg))

    res["ctx+fwd"] = _timed(ctx_fwd, n, pids)
    backward: list[float] = []

    def ctx_fwd_backward() -> None:
        with ag.context() as ctx:
            loss = rpc.rpc_sync(_PEER, forward, args=(rref, xg)).sum()
            t0 = time.perf_counter()
            ag.backward(ctx, [loss])
            backward.append(time.perf_counter() - t0)

    res["ctx+fwd+backward"] = _timed(ctx_fwd_backward, n, pids)
    res["backward alone"] = _latency(backward[-n:])  # the timed iterations only

    def step() -> None:
        with ag.context() as ctx:
            y = rpc.rpc_sync(_PEER, forward, args=(rref, torch.relu(local(x))))
            ag.backward(ctx, [y.pow(2).mean()])
            opt.step(ctx)

    res["step"] = _timed(step, n, pids)
    return res


def _worker(system: str, rank: int, port: int, out: str, n: int, poll: int) -> None:
    rpc = importlib.import_module(_MODULES[system])
    import torch.distributed.rpc as torch_rpc

    init = f"tcp://127.0.0.1:{port}"
    if poll:  # asyncrpc's own option, in its own options class
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=init, rpc_timeout=120, busy_poll_us=poll
        )
    else:
        options = torch_rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        Path(out).write_text(json.dumps(_measure(system, n)))
    rpc.shutdown()


# -- the launcher (the orchestrator's side) -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_plain(
    system: str, n: int, log_dir: Path, timeout: float, busy_poll_us: int = 0
) -> dict[str, dict[str, float]]:
    """Run the plain program once with ``system`` (``torch`` or ``asyncrpc``) in two fresh
    processes, ``n`` timed iterations per row; return each row's statistics. asyncrpc's
    workers poll their lanes ``busy_poll_us`` µs when it is given (asyncrpc's option).

    Raises:
        PlainError: a process failed, or they did not finish within ``timeout`` seconds
            (both are killed, by the PIDs started here).
    """
    out = log_dir / f"plain-{system}-{os.getpid()}-{time.monotonic_ns()}.json"
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    port = _free_port()
    procs = []
    with open(log_dir / f"plain-{system}.log", "ab") as log:
        for rank in range(2):
            argv = [sys.executable, "-P", __file__, system, str(rank), str(port), str(out),
                    str(n), str(busy_poll_us)]  # fmt: skip
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
    try:
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        raise PlainError(f"the plain {system} program did not finish in {timeout:.0f} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    if any(codes) or not out.exists():
        raise PlainError(f"the plain {system} program failed (exit codes {codes}); see {log_dir}")
    rows: dict[str, dict[str, float]] = json.loads(out.read_text())
    out.unlink()
    return rows


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("system", choices=tuple(_MODULES))
    for name in ("rank", "port"):
        parser.add_argument(name, type=int)
    parser.add_argument("out")
    parser.add_argument("n", type=int)
    parser.add_argument("poll", type=int, nargs="?", default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _parse(sys.argv[1:])
    _worker(args.system, args.rank, args.port, args.out, args.n, args.poll)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip tearing down an interpreter that imported torch (over a second)
