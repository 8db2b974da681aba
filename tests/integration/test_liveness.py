"""Liveness: a hung peer (SIGSTOP) is found by heartbeats, with real processes.

``scenarios.hang_peer`` is the driver, in a group of its own: heartbeats every 0.2 s and a
silence limit of 1 s on every worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

pytestmark = pytest.mark.timeout(120)
HEARTBEATS = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.0"]


@pytest.fixture(scope="module")
def hung_peer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path: Path = tmp_path_factory.mktemp("hang")
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(f"w{r}", r, 3, init, log_dir=tmp_path, rpc_timeout=30.0,
                     shutdown_timeout=10.0, extra_args=HEARTBEATS)
        for r in (1, 2)
    ]  # fmt: skip
    driver = scenarios.start("hang_peer", "--init-method", init)
    try:
        driver.wait_line("STARTED", 30.0)
        os.kill(workers[0].pid, signal.SIGSTOP)  # only the PID we started
        driver.send("STOPPED")
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[0].pid, signal.SIGCONT)
        stop_workers(workers, timeout=10.0)  # waits for each to exit (bounded)
    obs.update(code=code, logs=driver.text() + "".join(w.log() for w in workers))
    return obs


def test_Heartbeat_pending_call_with_no_timeout_fails_when_the_peer_hangs(
    hung_peer: dict[str, Any],
) -> None:
    obs = hung_peer
    assert obs["code"] == 0, obs["logs"]
    assert obs["running_on_w1"] is True
    assert obs["stdin"] == "STOPPED"
    error = obs["pending"]["error"]
    assert error is not None, obs["pending"]
    assert error["type"] == "PeerLostError"
    assert error["worker"] == "w1"
    assert "no sign of life" in error["message"]
    # Found by the 1 s silence limit, not by the call (it has none) nor its 60 s sleep.
    assert obs["detected_after"] is not None
    assert obs["detected_after"] < 10.0


def test_Heartbeat_later_calls_fail_fast_and_shutdown_does_not_wait(
    hung_peer: dict[str, Any],
) -> None:
    later = hung_peer["later_w1"]
    assert later["error"]["type"] == "PeerLostError"
    assert later["elapsed"] < 0.5
    assert hung_peer["debug_lost_peers"] == ["w1"]
    # The survivors leave the hung w1 out of the barriers: no wait for it, a warning.
    shutdown = hung_peer["shutdown"]
    assert shutdown["error"] is None, shutdown
    assert "worker(s) 'w1' died before shutdown" in hung_peer["logs"]
    assert shutdown["elapsed"] < 5.0


def test_Heartbeat_no_false_positive_for_a_busy_live_peer(hung_peer: dict[str, Any]) -> None:
    # w2 ran a 3 s call (its thread pool busy, its loop free) and 256 calls meanwhile.
    assert hung_peer["w2_long"]["value"] == "slept", hung_peer["w2_long"]
    assert hung_peer["w2_calls_ok"] is True
