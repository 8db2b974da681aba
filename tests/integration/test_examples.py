"""The examples run as a user runs them (subprocesses, small sizes), with their checks."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from examples._launch import EXIT_OVERTIME

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


def test_pipeline_parallel_matches_single_process(tmp_path: Path) -> None:
    out = tmp_path / "pp.json"
    proc = _run("examples.pipeline_parallel", "--steps", "8", "--micro-batches", "4",
                "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["match"] is True
    assert result["moved"] is True  # every part, the trainer's encoder too, was trained
    assert result["losses"] == pytest.approx(result["reference"], rel=1e-5, abs=1e-6)
    assert result["weight_diff"] < 1e-6


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


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _worker_pids(stdout: str) -> list[int]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("WORKERS "))
    return [int(pid) for pid in line.removeprefix("WORKERS ").strip("[]").split(",")]


def test_example_stopped_at_its_deadline_with_its_workers() -> None:
    """A run whose main process and worker both wait for good: the launcher's watchdog
    kills the worker, says where the main process was, and exits with EXIT_OVERTIME."""
    proc = _run("tests.integration.stuck_example", "--stuck", "main", "--deadline", "3")
    assert proc.returncode == EXIT_OVERTIME, proc.stdout + proc.stderr
    assert "deadline" in proc.stderr
    assert "stuck_example.py" in proc.stderr  # the main thread's stack
    assert all(_gone(pid) for pid in _worker_pids(proc.stdout))


def test_example_worker_that_never_exits_is_killed_and_reported() -> None:
    proc = _run("tests.integration.stuck_example", "--stuck", "worker", "--exit-grace", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "worker ranks [1] still running" in proc.stderr
    assert all(_gone(pid) for pid in _worker_pids(proc.stdout))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def test_actor_learner_fails_at_once_when_an_actor_dies(tmp_path: Path) -> None:
    """The learner waits on a queue its actors' streams fill: an actor that dies ends the
    run with the stream's error, not a wait for unrolls that never come."""
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", "examples.actor_learner", "--actors", "2",
             "--unrolls", "100000", "--deadline", "180"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout or ():
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not lines.get(timeout=150).startswith("update"):  # the actors are streaming
            pass
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
    text = errors.read_text()
    assert proc.returncode == 1, text
    assert "PeerLostError" in text
    assert "deadline" not in text


def test_parameter_server_drops_a_lost_trainer_and_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "drop.json"
    proc = _run("examples.failures.drop_trainer", "--trainers", "3", "--steps", "10",
                "--die-after", "3", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    # Every step applied: three trainers until the last one died, two after it.
    assert result["trainers_per_step"] == [3, 3, 3] + [2] * 7, result
    assert result["dropped"] == [["trainer3", "redial_refused"]]
    assert result["losses"][-1] < result["losses"][0]


def test_trainer_fails_over_to_the_standby_with_the_weights_of_one_process(
    tmp_path: Path,
) -> None:
    out = tmp_path / "failover.json"
    proc = _run("examples.failures.failover", "--steps", "10", "--hang-at", "4",
                "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["server"] == "standby"
    assert result["failed_calls"] == 1  # the update the primary froze in, sent again
    assert result["matches_one_process"] is True  # applied once on the standby
    # The heartbeat, not the call's 60 s timeout: the primary freezes before a probe has
    # seen its process answer, so 10 s of silence decide (docs/reliability.md).
    assert 0.0 < result["found_after_s"] < 15.0
