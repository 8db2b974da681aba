"""The examples run as a user runs them (subprocesses, small sizes), with their checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip


def test_parameter_server_loss_falls(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    proc = _run("examples.parameter_server", "--trainers", "2", "--steps", "12",
                "--lr", "0.5", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    losses = result["losses"]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert "step  12/12" in proc.stdout


def test_model_parallel_matches_single_process(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    proc = _run("examples.model_parallel", "--steps", "6", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["match"] is True
    assert result["losses"] == pytest.approx(result["reference"], abs=1e-5)
    assert result["async_losses"] == pytest.approx(result["reference"], abs=1e-5)


def test_torch_migration_versions_agree() -> None:
    proc = _run("examples.torch_migration")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split(None, 1) for line in proc.stdout.splitlines() if "result:" in line]
    plain = {result for name, result in lines if not name.endswith("_autograd")}
    autograd = {result for name, result in lines if name.endswith("_autograd")}
    assert len(lines) >= 3
    assert len(plain) == 1
    assert len(autograd) == 1
    assert "asyncrpc_autograd" in proc.stdout


def test_actor_learner_reward_rises_with_bounded_lag(tmp_path: Path) -> None:
    out = tmp_path / "al.json"
    proc = _run("examples.actor_learner", "--actors", "2", "--unrolls", "40",
                "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["updates"] == len(result["rewards"]) == 80
    assert result["last"] > result["first"]
    # Each actor runs at most its window (2 unrolls) ahead; what lags is bounded, not growing.
    assert result["max_lag"] < 40
    assert "(rose)" in proc.stdout
