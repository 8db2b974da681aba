"""Start the worker processes of an example and always stop them (shared by the examples).

Each example's main process is rank 0; the other ranks are ``python -m <module> --role
worker ...`` subprocesses of the same example, stopped by the PID we started in ``finally``.
A whole run is bounded: past its deadline a watchdog thread prints where the main process
is, kills the workers and ends the process with ``EXIT_OVERTIME``, whatever the main
thread is waiting for (a queue no worker will fill, a blocking call).
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

DEADLINE_S = 300.0  # the default bound of a whole run (an example's ``--deadline``)
EXIT_GRACE_S = 30.0  # how long the workers get to exit once the main process is done
EXIT_OVERTIME = 124  # the exit status of a run stopped at its deadline (as timeout(1))


@contextmanager
def workers(
    module: str,
    ranks: Sequence[int],
    world_size: int,
    init_method: str,
    extra: Sequence[str] = (),
    deadline: float = DEADLINE_S,
    exit_grace: float = EXIT_GRACE_S,
    may_fail: Sequence[int] = (),
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Spawn ``python -m module --role worker --rank r ...`` for each rank; kill leftovers.

    Args:
        module: the example's module (its ``main`` takes ``--role worker --rank R
            --world-size W --init-method URL`` and ``extra``).
        ranks: the ranks to start (rank 0 is the calling process).
        world_size: size of the whole group.
        init_method: the rendezvous URL.
        extra: more command-line arguments for every worker.
        deadline: seconds from now after which the run is stopped: the workers are
            killed and this process exits with ``EXIT_OVERTIME``.
        exit_grace: seconds the workers get to exit after the block (within the deadline).
        may_fail: ranks the example itself kills or stops (a lost worker is its subject):
            their exit is not checked, and one still running is killed.

    Yields:
        The started processes.

    Raises:
        RuntimeError: a worker exited with a non-zero code, or was still running
            ``exit_grace`` seconds after the block (it is killed).
    """
    env = dict(os.environ)
    # torch warns at import when numpy is absent; the examples do not use numpy.
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--role", "worker", "--rank", str(r),
             "--world-size", str(world_size), "--init-method", init_method, *extra],
            env=env, cwd=ROOT,
        )
        for r in ranks
    ]  # fmt: skip
    watchdog = _Watchdog(procs, deadline)
    try:
        yield procs
        checked = [(r, p) for r, p in zip(ranks, procs, strict=True) if r not in may_fail]
        codes = _wait_all([p for _, p in checked], min(exit_grace, watchdog.left()))
        _check([r for r, _ in checked], codes, exit_grace)
    finally:
        watchdog.stop()
        _kill(procs)


class _Watchdog:
    """Stops the run at its deadline from a thread of its own: the main thread may be
    stuck anywhere, and only the process's end is sure to stop it."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
        self._procs = procs
        self._deadline = deadline
        self._ends = time.monotonic() + deadline
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="example-watchdog", daemon=True).start()

    def left(self) -> float:
        """Seconds until the deadline."""
        return max(0.0, self._ends - time.monotonic())

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self._deadline):
            return
        print(f"\nexample still running at its {self._deadline:g} s deadline: stopping "
              f"workers {[p.pid for p in self._procs]} and exiting; this process's "
              "threads were at:", file=sys.stderr, flush=True)  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _kill(self._procs)
        os._exit(EXIT_OVERTIME)  # the main thread may never return: end the process


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    """Each worker's exit code, None for one still running after ``timeout`` (in all)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p.poll() for p in procs]


def _check(ranks: Sequence[int], codes: Sequence[int | None], grace: float) -> None:
    stuck = [rank for rank, code in zip(ranks, codes, strict=True) if code is None]
    failed = {rank: code for rank, code in zip(ranks, codes, strict=True) if code}
    if stuck:
        raise RuntimeError(
            f"worker ranks {stuck} still running {grace:g} s after the main process was "
            f"done: killed (exit codes of the others: {failed or 'all 0'})"
        )
    if failed:
        raise RuntimeError(f"worker exit codes: {failed}")


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # only the PIDs we started
            p.wait(10)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write the example's final metrics to ``path`` (for tests), if one was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2))
