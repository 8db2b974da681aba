"""The group of the stream and duplex fault tests (test layer): w1 and a scenario driver
(``tests/scenarios/stream.py``, ``duplex.py``) in a group of their own, w1 killed when the
driver says it is streaming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios


def run_with_w1(name: str, tmp_path: Path, kill: bool) -> tuple[dict[str, Any], list[int | None]]:
    """Run the scenario ``name`` as rank 0 of a two-worker group with w1.

    With ``kill``, w1 is killed (SIGKILL) once the driver prints ``STREAMING``, and the
    driver is told ``KILLED``. Both processes are gone when this returns.

    Returns:
        The driver's observations and w1's exit code.
    """
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=tmp_path, rpc_timeout=20.0,
                          shutdown_timeout=20.0)  # fmt: skip
    driver = scenarios.start(name, "--init-method", init)
    try:
        if kill:
            driver.wait_line("STREAMING", 60)
            worker.kill()
            driver.send("KILLED")
        code, obs = driver.result(60)
        assert code == 0, driver.text()
    finally:
        driver.kill()
        codes = stop_workers([worker], timeout=15)
    return obs, codes
