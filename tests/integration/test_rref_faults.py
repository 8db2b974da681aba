"""RRefs across faults between real processes: the owner SIGKILLed, a user SIGKILLed, and a
graceful shutdown while users still hold RRefs.

Each scenario runs in a group of its own (``tests/scenarios/rref.py`` is its driver, rank 0)
with real worker processes on 127.0.0.1; every process we start is killed by its PID in ``finally``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrpc.testing import WorkerProcess, free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.scenarios import ScenarioProcess
from tests.scenarios.rref import DEBUG_KEYS

pytestmark = pytest.mark.timeout(180)  # the first test of each group pays its start-up


def _spawn(ranks: tuple[int, ...], init: str, log_dir: Path) -> list[WorkerProcess]:
    return [
        spawn_worker(f"w{r}", r, 4, init, log_dir=log_dir, rpc_timeout=10.0,
                     shutdown_timeout=10.0)
        for r in ranks
    ]  # fmt: skip


def _run_kill(scenario: str, log_dir: Path) -> dict[str, Any]:
    """Run ``scenario`` with w1..w3; SIGKILL w1 (by the PID we started) once it is READY."""
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = _spawn((1, 2, 3), init, log_dir)
    driver = scenarios.start(scenario, "--init-method", init)
    killed_at = None
    try:
        driver.wait_line("READY", 60.0)
        killed_at = time.monotonic()
        workers[0].kill()
        driver.send("KILLED")
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        codes = stop_workers(workers, timeout=20.0)
    obs.update(code=code, killed_at=killed_at, w1_pid_started=workers[0].pid, worker_codes=codes)
    obs.update(logs=driver.text() + "".join(w.log() for w in workers))
    return obs


def _assert_owner_lost(attempt: dict[str, Any], logs: str) -> None:
    error = attempt["error"]
    assert error is not None, (attempt, logs)
    assert error["type"] == "RRefOwnerLostError", attempt
    assert "ConnectionError" in error["mro"]
    assert error["owner"] == "w1"
    assert attempt["elapsed"] < 2.0


# -- the owner is killed -------------------------------------------------------------------


@pytest.fixture(scope="module")
def owner_killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_kill("owner_killed", tmp_path_factory.mktemp("owner_killed"))


def test_RRef_setup_before_owner_kill(owner_killed: dict[str, Any]) -> None:
    obs = owner_killed
    assert obs["code"] == 0, obs["logs"]
    assert obs["w1_pid"] == obs["w1_pid_started"]
    assert obs["stdin"] == "KILLED"
    assert obs["before_value"] == 5
    assert obs["w2_settled"]
    assert obs["w3_settled"]
    assert obs["before_driver"]["user_rrefs"] == 2  # the counter and the computing value
    assert obs["before_w2"]["user_rrefs"] == 1


def test_RRef_pending_to_here_fails_when_owner_is_killed(owner_killed: dict[str, Any]) -> None:
    obs = owner_killed
    _assert_owner_lost(obs["pending_to_here"], obs["logs"])
    assert obs["failed_at"], obs["pending_to_here"]
    assert obs["failed_at"][0] - obs["killed_at"] < 1.0


def test_RRef_to_here_after_owner_kill_raises_owner_lost(owner_killed: dict[str, Any]) -> None:
    obs = owner_killed
    _assert_owner_lost(obs["to_here_first"], obs["logs"])
    _assert_owner_lost(obs["to_here"], obs["logs"])


def test_RRef_proxies_after_owner_kill_raise_owner_lost(owner_killed: dict[str, Any]) -> None:
    obs = owner_killed
    for name in ("rpc_sync_proxy", "rpc_async_proxy", "remote_proxy"):
        _assert_owner_lost(obs[name], obs["logs"])


def test_RRef_forked_user_on_third_worker_sees_owner_lost(owner_killed: dict[str, Any]) -> None:
    obs = owner_killed
    # The error is raised on w2 and travels back to the driver with its type.
    _assert_owner_lost(obs["held_on_w2"], obs["logs"])
    assert obs["identity"] == ["w1", False]


def test_RRef_lost_user_forks_are_not_counted(owner_killed: dict[str, Any]) -> None:
    assert owner_killed["after_driver"]["user_rrefs"] == 0
    assert owner_killed["after_driver"]["pending_users"] == 0
    assert owner_killed["after_w2"]["user_rrefs"] == 0


def test_shutdown_after_owner_kill_is_bounded(owner_killed: dict[str, Any]) -> None:
    # The survivors shut down together without the dead owner, and say it died.
    obs = owner_killed
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert obs["shutdown"]["elapsed"] < 5.5
    assert "worker(s) 'w1' died before shutdown" in obs["logs"]
    assert obs["worker_codes"][0] == -signal.SIGKILL
    assert obs["worker_codes"][1:] == [0, 0], obs["logs"]


# -- a user is killed ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def user_killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_kill("user_killed", tmp_path_factory.mktemp("user_killed"))


def test_RRef_setup_before_user_kill(user_killed: dict[str, Any]) -> None:
    obs = user_killed
    assert obs["code"] == 0, obs["logs"]
    assert obs["w1_pid"] == obs["w1_pid_started"]
    assert obs["w1_holds"] == 6  # 2 RRef(value) forks + 3 fetched remote() + 1 computing
    assert [obs[f"w{r}_settled"] for r in (1, 2, 3)] == [True] * 3
    assert obs["before_driver"]["owner_rrefs"] == 6


def test_RRef_owner_reclaims_what_a_killed_user_held(user_killed: dict[str, Any]) -> None:
    obs = user_killed
    # Everything w1 alone held is freed; the RRef w1 passed on to w2 and w3 survives it.
    assert obs["after_kill"]["owner_rrefs"] == 1, obs["logs"]
    assert obs["reclaimed_after"] < 2.0
    assert obs["held_on_w2"] == {"value": 7, "error": None, "elapsed": obs["held_on_w2"]["elapsed"]}


def test_RRef_owner_frees_the_survivor_once_the_others_drop_it(user_killed: dict[str, Any]) -> None:
    obs = user_killed
    assert obs["dropped"] == [1, 1]
    assert obs["after_drop"] == dict.fromkeys(DEBUG_KEYS, 0)
    # The value a dead caller's remote() was computing is discarded when it finishes.
    assert obs["late_value_done"] is True
    assert obs["after_late_value"] == dict.fromkeys(DEBUG_KEYS, 0)


def test_shutdown_after_user_kill_is_bounded(user_killed: dict[str, Any]) -> None:
    obs = user_killed
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert obs["shutdown"]["elapsed"] < 5.5
    assert "worker(s) 'w1' died before shutdown" in obs["logs"]
    assert obs["worker_codes"][0] == -signal.SIGKILL
    assert obs["worker_codes"][1:] == [0, 0], obs["logs"]


# -- graceful shutdown with live RRefs -----------------------------------------------------


@pytest.fixture(scope="module")
def live_shutdown(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """driver (rref_leaks="error"), w1, w2 and w3 (a leak-checked member) all shut down
    gracefully while w1 and w2 hold RRefs owned by the driver and by w3."""
    log_dir = tmp_path_factory.mktemp("live_shutdown")
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = _spawn((1, 2), init, log_dir)
    procs: list[ScenarioProcess] = []
    try:
        procs.append(scenarios.start("leak_checked_member", "--init-method", init,
                                     "--name", "w3", "--rank", "3"))  # fmt: skip
        procs.append(scenarios.start("live_rrefs_shutdown", "--init-method", init))
        w3_code, w3_obs = procs[0].result(60.0)
        code, obs = procs[1].result(60.0)
    finally:
        for proc in procs:
            proc.kill()
        codes = stop_workers(workers, timeout=20.0)
    obs.update(code=code, w3_code=w3_code, w3=w3_obs, worker_codes=codes)
    obs.update(logs="".join(p.text() for p in procs) + "".join(w.log() for w in workers))
    return obs


def test_shutdown_with_live_rrefs_completes_everywhere(live_shutdown: dict[str, Any]) -> None:
    obs = live_shutdown
    assert obs["shutdown"]["error"] is None, obs["logs"]
    assert obs["w3"]["shutdown"]["error"] is None, obs["logs"]
    assert (obs["code"], obs["w3_code"], obs["worker_codes"]) == (0, 0, [0, 0]), obs["logs"]


def test_shutdown_with_live_rrefs_had_remote_users(live_shutdown: dict[str, Any]) -> None:
    obs = live_shutdown
    # What was live when shutdown began: otherwise the leak check would prove nothing.
    assert obs["driver_remotely_held"] == 3  # RRef(value) + two remote() from w2
    assert obs["w1_before"]["user_rrefs"] == 2
    assert obs["w2_before"]["user_rrefs"] == 7  # 2 held + 1 forwarded by w1 + 4 remote()
    assert obs["w3_before"]["owner_rrefs"] == 3
    assert obs["kept_owner_names"] == ["w3", "driver"]


def test_shutdown_with_live_rrefs_reports_no_leak(live_shutdown: dict[str, Any]) -> None:
    # rref_leaks="error" on both owners turns a leak into a ShutdownError (checked above);
    # the warn-mode workers must not have logged one either.
    assert "still referenced" not in live_shutdown["logs"]
