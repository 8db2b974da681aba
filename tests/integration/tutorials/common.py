"""What the tutorial programs share: the command line, the launcher of their ranks, and
where each rank writes its results.

A program is ``python -m tests.integration.tutorials.<name> --impl torch|asyncrpc --out DIR``,
at the short lengths ``make test`` runs, or with ``--full`` at the default lengths of the
pytorch/examples program it stands for (``make examples-torch``).
That process imports the program (and so torch and the chosen RPC module) once, then
forks one process per rank, as ``torch.multiprocessing`` would, but without each rank
importing torch again (on two cores, imports were most of the suite's time). Ranks meet
on 127.0.0.1 through ``env://`` (``MASTER_ADDR``/``MASTER_PORT``, as the tutorials do);
each writes what it measured to ``DIR/rank<r>.pt`` and its output to ``DIR/rank<r>.log``.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
IMPLS = ("torch", "asyncrpc")
_PR_SET_PDEATHSIG = 1

# Modules are built on the callee's pool threads, maybe two at once: seeding torch's one
# global generator and drawing the initial weights must happen as one step.
_SEEDED = threading.Lock()


def impl() -> str:
    """The ``--impl`` of this process's command line: which RPC module the program imports."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--impl", choices=IMPLS, required=True)
    args, _ = parser.parse_known_args()
    return str(args.impl)


def full() -> bool:
    """Whether this process's command line asks for the upstream program's lengths.

    Read at import, as ``impl()`` is: the programs size themselves in module constants.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--full", action="store_true")
    args, _ = parser.parse_known_args()
    return bool(args.full)


def main(
    world_size: int,
    run: Callable[[argparse.Namespace], None],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """A program's entry point: fork its ranks and wait for them.

    Args:
        world_size: how many ranks the program has.
        run: the body of one rank; it gets the command line plus ``rank``, ``world_size``
            and ``pg_port`` (a free port for a c10d process group).
        add_arguments: adds the program's own options to the command line.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<r>.pt")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--full", action="store_true", help="the upstream program's lengths")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    codes = _fork_ranks(world_size, run, args)
    if codes != [0] * world_size:
        sys.exit(f"rank exit codes {codes} (None: killed after {args.timeout} s)")


def _fork_ranks(
    world_size: int, run: Callable[[argparse.Namespace], None], args: argparse.Namespace
) -> list[int | None]:
    context = multiprocessing.get_context("fork")
    pg_port = free_port()
    procs = []
    try:
        for rank in range(world_size):
            rank_args = argparse.Namespace(**vars(args), rank=rank, world_size=world_size,
                                           pg_port=pg_port)  # fmt: skip
            proc = context.Process(target=_run_rank, args=(run, rank_args), name=f"rank{rank}")
            proc.start()
            procs.append(proc)
        # Stop waiting as soon as one rank fails: its peers may wait for it forever.
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs]
            if all(c is not None for c in codes) or any(codes):
                break
            time.sleep(0.05)
        return [p.exitcode for p in procs]
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()  # only the PIDs we started
                proc.join(10)


def _run_rank(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    # Die with the launcher, even if it is SIGKILLed and cannot clean up.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    log = os.open(args.out / f"rank{args.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # One intra-op thread: ranks share two cores, and results must not depend on the split.
    torch.set_num_threads(1)
    try:
        run(args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def save(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Write this rank's results where ``run_program`` collects them."""
    torch.save(data, args.out / f"rank{args.rank}.pt")


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global generator and hold it while the block draws initial weights."""
    with _SEEDED:
        torch.manual_seed(seed)
        yield


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS picks it).

    Not ``asyncrpc.testing.free_port``: a ``--impl torch`` program must not import asyncrpc.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_program(
    name: str, impl_name: str, out: Path, timeout: float = 60.0, argv: tuple[str, ...] = ()
) -> dict[int, Any]:
    """Run ``tests.integration.tutorials.<name> --impl impl_name``; return each rank's results.

    The program kills its ranks when they outlive ``timeout``; it is itself killed (by the
    PID we started) ``timeout`` + 20 s after starting, and its ranks die with it.

    Args:
        name: the program's module name in this package.
        impl_name: ``torch`` or ``asyncrpc``.
        out: folder for results and logs (created).
        timeout: seconds the program's ranks may run.
        argv: more of the program's command line (``--full``, its own options).

    Returns:
        ``{rank: results}`` for the ranks that saved results.

    Raises:
        RuntimeError: the program failed or ran too long; with every rank's log.
    """
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        OMP_NUM_THREADS="1",
        # torch warns at import when numpy is absent; the programs do not use numpy.
        PYTHONWARNINGS="ignore:Failed to initialize NumPy",
    )  # fmt: skip
    command = [sys.executable, "-m", f"tests.integration.tutorials.{name}", "--impl", impl_name,
               "--out", str(out), "--timeout", str(timeout), *argv]  # fmt: skip
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout + 20.0)
    except subprocess.TimeoutExpired:
        output = b"(killed: ran too long)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {p.stem} ({impl_name}) ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(out.glob("rank*.log"))
        )
        raise RuntimeError(
            f"{name} --impl {impl_name} {' '.join(argv)} exited with {proc.returncode}:\n"
            f"{output.decode(errors='replace')[-2000:]}\n{logs}"
        )
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in out.glob("rank*.pt")}
