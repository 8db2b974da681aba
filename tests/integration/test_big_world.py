"""32 workers on one host: they all join, every worker calls every other (992 calls, all
pairs concurrently), and the graceful shutdown completes on every one.

``BIG_WORLD`` sets the size (32 by default)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

pytestmark = pytest.mark.timeout(400)
SIZE = int(os.environ.get("BIG_WORLD", "32"))


def test_big_world_every_pair_calls_and_all_shut_down(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(f"b{r}", r, SIZE, init, log_dir=tmp_path, rpc_timeout=120.0,
                     shutdown_timeout=120.0, extra_args=["--threads", "4"])
        for r in range(1, SIZE)
    ]  # fmt: skip
    driver = scenarios.start(
        "big_world", "--init-method", init, "--world-size", str(SIZE),
        "--rpc-timeout", "120", "--shutdown-timeout", "120",
    )  # fmt: skip
    try:
        code, obs = driver.result(360.0)
    finally:
        driver.kill()
        codes = stop_workers(workers, timeout=60.0)
    logs = driver.text() + "".join(w.log() for w in workers[:3])
    print(f"{SIZE} workers: init {obs.get('init_s', 0):.1f} s, all pairs "
          f"{obs.get('calls_s', 0):.1f} s, shutdown {obs.get('shutdown_s', 0):.1f} s")  # fmt: skip
    assert code == 0, logs
    assert obs["answers"]["value"] == [SIZE - 1] * SIZE, obs["answers"]
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert codes == [0] * (SIZE - 1), logs
