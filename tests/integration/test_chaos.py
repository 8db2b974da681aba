"""Regressions the chaos soak found."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests.integration import scenarios


@pytest.mark.timeout(120)
def test_autograd_release_lost_with_a_connection_reaches_the_peer(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    port, proxy_port = free_port(), free_port()
    behind = ["--listen-port", str(port), "--advertise-port", str(proxy_port)]
    worker = spawn_worker("k1", 1, 2, init, log_dir=tmp_path, rpc_timeout=20.0,
                          shutdown_timeout=20.0, extra_args=behind)  # fmt: skip
    driver = scenarios.start(
        "release_after_drop", "--init-method", init, "--port", str(port),
        "--proxy-port", str(proxy_port), module="tests.integration.chaos_scenarios",
    )  # fmt: skip
    try:
        code, obs = driver.result(100.0)
    finally:
        driver.kill()
        codes = stop_workers([worker], timeout=20.0)
    logs = driver.text() + worker.log()
    assert code == 0, logs
    assert obs["during"] == 1, obs
    assert obs["released"] is True, obs
    assert obs["after"] == 0
    assert codes == [0], logs
