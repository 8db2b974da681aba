"""Run a small group of ``python -m MODULE --rank R`` processes on 127.0.0.1 for the
observability tests, always reaped (killed by PID past the bound)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrpc.testing import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_group(
    module: str, world: int, extra: list[str], log_dir: Path, timeout: float = 90.0
) -> list[str]:
    """Start ranks 0..world-1 of ``module``; wait for all; each one's output (rank order).

    Raises:
        AssertionError: a process failed or outlived ``timeout`` (then it was killed).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for rank in range(world):
            log = log_dir / f"{module.rsplit('.', 1)[-1]}-{rank}.log"
            with open(log, "wb") as out:
                cmd = [
                    sys.executable,
                    "-m",
                    module,
                    "--rank",
                    str(rank),
                    "--init-method",
                    init,
                    *extra,
                ]
                procs.append(
                    (
                        subprocess.Popen(
                            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
                        ),
                        log,
                    )
                )
        codes = [proc.wait(timeout) for proc, _ in procs]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    outputs = [log.read_text(errors="replace") for _, log in procs]
    assert codes == [0] * world, f"exit codes {codes}\n" + "\n".join(outputs)
    return outputs
