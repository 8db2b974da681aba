"""The chaos soak (``asyncrpc.testing.chaos``) for half a minute, and the regressions it found.

The soak runs in ``make test``; ``-m 'not chaos'`` deselects it where a run must be short.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from asyncrpc.testing import chaos, free_port, spawn_worker, stop_workers
from tests import scenarios

SECONDS = float(os.environ.get("CHAOS_SECONDS", "30"))


@pytest.mark.chaos
@pytest.mark.timeout(SECONDS + 540)
def test_chaos_soak_loses_duplicates_and_mixes_up_nothing(tmp_path: Path) -> None:
    args = argparse.Namespace(duration=SECONDS, workers=8, seed=int(os.environ.get(
        "CHAOS_SEED", "1")), start_timeout=300.0, work=tmp_path,
        calls=0, faults=True)  # fmt: skip
    report = chaos.soak(args)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    chaos._print(report)
    assert report["failures"] == [], report["failures"]
    assert report["ops"] > 0
    assert report["outcomes"].get("ok", 0) > report["ops"] // 2  # mostly work, not errors
    assert sum(report["faults"].values()) > 0


@pytest.mark.timeout(120)
def test_autograd_release_lost_with_a_connection_reaches_the_peer(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    port, proxy_port = free_port(), free_port()
    behind = ["--listen-port", str(port), "--advertise-port", str(proxy_port)]
    worker = spawn_worker("k1", 1, 2, init, log_dir=tmp_path, rpc_timeout=20.0,
                          shutdown_timeout=20.0, extra_args=behind)  # fmt: skip
    driver = scenarios.start(
        "release_after_drop", "--init-method", init, "--port", str(port),
        "--proxy-port", str(proxy_port),
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
