"""Start the worker processes of an example and always stop them (shared by the examples).

Each example's main process is rank 0; the other ranks are ``python -m <module> --role
worker ...`` subprocesses of the same example, stopped by the PID we started in ``finally``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def workers(
    module: str, ranks: Sequence[int], world_size: int, init_method: str, extra: Sequence[str] = ()
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Spawn ``python -m module --role worker --rank r ...`` for each rank; kill leftovers.

    Args:
        module: the example's module (must accept the arguments of ``worker_args``).
        ranks: the ranks to start (rank 0 is the calling process).
        world_size: size of the whole group.
        init_method: the rendezvous URL.
        extra: more command-line arguments for every worker.

    Yields:
        The started processes.

    Raises:
        RuntimeError: a worker exited with a non-zero code.
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
    try:
        yield procs
        codes = [_wait(p, 30.0) for p in procs]
        if any(codes):
            raise RuntimeError(f"worker exit codes: {codes}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only the PIDs we started
                p.wait(10)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc.poll()


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write the example's final metrics to ``path`` (for tests), if one was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2))
