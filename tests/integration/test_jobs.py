"""A torch-style job over real processes: a parameter server in ``shutdown()`` from the
start, trainers calling it, and one trainer SIGKILLed mid-job (``scenarios.ps_job``).

The survivors must finish their work and their shutdown together; the dead trainer is
reported as ``lost_workers`` says. The same job at a user's lengths (minutes) runs in
``make test-long`` (``-m long``).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from asyncrpc import RpcBackendOptions
from asyncrpc.testing import free_port
from tests import scenarios

pytestmark = pytest.mark.timeout(150)


def run_job(
    tmp_path: Path,
    trainers: int,
    seconds: float,
    kill: int | None = None,
    lost_workers: str = "warn",
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Run a ps and ``trainers`` trainers; SIGKILL trainer ``kill`` once it has started.

    Returns each process's observations and exit code, by name.
    """
    init = f"tcp://127.0.0.1:{free_port()}"
    common = ["--init-method", init, "--world-size", str(trainers + 1),
              "--lost-workers", lost_workers, "--seconds", str(seconds)]  # fmt: skip
    ps = ["--role", "ps", "--name", "ps", "--rank", "0"]
    procs = {"ps": scenarios.start("ps_job", *common, *ps)}
    for rank in range(1, trainers + 1):
        procs[f"trainer{rank}"] = scenarios.start(
            "ps_job", *common, "--role", "trainer", "--name", f"trainer{rank}", "--rank", str(rank)
        )
    results: dict[str, Any] = {}
    try:
        for name, proc in procs.items():
            if name != "ps":
                proc.wait_line("STARTED", 60.0)
        if kill is not None:
            procs[f"trainer{kill}"].kill()
        for name, proc in procs.items():
            if name == f"trainer{kill}":
                results[name] = {"code": proc.process.returncode}
                continue
            code, obs = proc.result(timeout)
            results[name] = {**obs, "code": code, "log": proc.text()}
    finally:
        for proc in procs.values():
            proc.kill()
    return results


@pytest.fixture(scope="module")
def one_trainer_killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job(tmp_path_factory.mktemp("job"), trainers=3, seconds=4.0, kill=1)


def test_ps_job_survivors_finish_their_work_when_a_trainer_is_killed(
    one_trainer_killed: dict[str, Any],
) -> None:
    job = one_trainer_killed
    assert job["trainer1"]["code"] == -signal.SIGKILL
    for name in ("trainer2", "trainer3"):
        assert job[name]["code"] == 0, job[name]["log"]
        assert job[name]["failures"] == [], job[name]["failures"]
        assert job[name]["calls"] > 10
        assert job[name]["shutdown"]["error"] is None, job[name]["shutdown"]


def test_ps_job_ps_serves_on_and_warns_of_the_dead_trainer(
    one_trainer_killed: dict[str, Any],
) -> None:
    ps = one_trainer_killed["ps"]
    assert ps["code"] == 0, ps["log"]
    assert ps["shutdown"]["error"] is None, ps["shutdown"]
    died = [w for w in ps["warnings"] if "died before shutdown" in w]
    assert len(died) == 1, ps["warnings"]
    assert "'trainer1'" in died[0]
    assert "'trainer2'" not in died[0]


def test_ps_job_strict_survivors_raise_WorkersLostError_after_finishing(tmp_path: Path) -> None:
    job = run_job(tmp_path, trainers=2, seconds=2.0, kill=1, lost_workers="error")
    for name in ("ps", "trainer2"):
        result = job[name]
        assert result["code"] == 0, result["log"]
        error = result["shutdown"]["error"]
        assert error is not None, result["shutdown"]
        assert error["type"] == "WorkersLostError", result["shutdown"]
        assert "ShutdownError" in error["mro"]
        assert "'trainer1'" in error["message"]
    assert job["trainer2"]["failures"] == []


def test_RpcBackendOptions_graceful_shutdown_has_no_limit_by_default() -> None:
    # torch's DEFAULT_SHUTDOWN_TIMEOUT is 0: no limit. A bound of 60 s stopped real jobs.
    assert RpcBackendOptions().shutdown_timeout is None


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seconds", [70.0, 600.0], ids=["70s", "10min"])
def test_ps_job_runs_for_as_long_as_its_trainers_train(tmp_path: Path, seconds: float) -> None:
    # A ps in shutdown() for longer than any old bound, with the default options.
    job = run_job(tmp_path, trainers=2, seconds=seconds, timeout=seconds + 120.0)
    for name, result in job.items():
        assert result["code"] == 0, result["log"]
        assert result["shutdown"]["error"] is None, (name, result["shutdown"])
    assert job["ps"]["shutdown_took"] > seconds * 0.9
    for name in ("trainer1", "trainer2"):
        assert job[name]["failures"] == []
