"""Run a scenario of the fake CUDA world (``cuda_world.py``) against one worker in it, for
the CUDA stream tests: the worker ``w1`` (rank 1 of 2) and the scenario as rank 0, both
in that world, no shared memory (items take the CUDA path, not a shared-memory chunk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

_IN_THE_WORLD = ["--import", "tests.integration.cuda_world_on", "--shared-memory", "0"]


def observe(scenario: str, log_dir: Path, env: dict[str, str] | None = None) -> Any:
    """Run ``scenario`` against ``w1`` (``env`` added to both processes' environment);
    what it observed. Asserts that both ended well, with their logs where not."""
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=log_dir, rpc_timeout=20.0,
                          shutdown_timeout=60.0, extra_args=_IN_THE_WORLD, env=env)  # fmt: skip
    driver = scenarios.start(scenario, "--init-method", init, env=env)
    try:
        code, obs = driver.result(90)
        assert code == 0, driver.text() + worker.log()
    finally:
        driver.kill()
        codes = stop_workers([worker], timeout=15)
    assert codes == [0], worker.log()
    return obs
