"""Across hosts, and launched the way torch programs are.

Three workers on three "hosts": network namespaces of our own, joined by veth pairs and a
bridge, with addresses only inside them (skipped without root or iproute2). h1 listens on
every interface and advertises its address. Then a world launched with ``torchrun``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrpc.testing import spawn_worker, stop_workers
from tests import scenarios
from tests.integration import netns

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_multi_host_calls_rrefs_and_shutdown_across_namespaces(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with netns.hosts(3) as (h0, h1, h2):
        init = f"tcp://{h0.address}:29500"
        workers = [
            spawn_worker("h1", 1, 3, init, log_dir=tmp_path, prefix=h1.exec_prefix(),
                         shutdown_timeout=30.0,
                         extra_args=["--listen-host", "0.0.0.0", "--advertise-host", h1.address]),
            spawn_worker("h2", 2, 3, init, log_dir=tmp_path, prefix=h2.exec_prefix(),
                         shutdown_timeout=30.0, extra_args=["--listen-host", h2.address]),
        ]  # fmt: skip
        driver = scenarios.start(
            "multi_host", "--init-method", init, "--listen-host", h0.address,
            "--rpc-timeout", "20", prefix=h0.exec_prefix(),
        )  # fmt: skip
        try:
            code, obs = driver.result(90.0)
        finally:
            driver.kill()
            codes = stop_workers(workers, timeout=30.0)
        logs = driver.text() + "".join(w.log() for w in workers)
    assert code == 0, logs
    assert obs["h1_add"]["value"] == 5, logs
    assert obs["h2_whoami"]["value"] == "h2"
    assert obs["rref_to_here"]["value"] == 4.0
    assert obs["h1_fetches_from_h2"]["value"] == 4.0
    assert obs["peers"] == {"h0": "h0", "h1": "h1", "h2": "h2"}
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert codes == [0, 0], logs


def test_torchrun_launches_a_world(tmp_path: Path) -> None:
    program = ROOT / "tests" / "integration" / "torchrun_program.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(program)],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torchrun world: ['worker0', 'worker1', 'worker2'] sum 6" in done.stdout
