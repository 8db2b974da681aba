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
    assert obs["checked"] is True  # w1's and w2's listeners answered a probe before
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


# -- the defaults: a stopped peer found in about 2-3 s, a blocked one kept -----------------


@pytest.fixture(scope="module")
def hung_by_default(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path: Path = tmp_path_factory.mktemp("hang_defaults")
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(f"w{r}", r, 4, init, log_dir=tmp_path, rpc_timeout=30.0,
                     shutdown_timeout=10.0)  # the library's heartbeat defaults
        for r in (1, 2, 3)
    ]  # fmt: skip
    driver = scenarios.start("hang_defaults", "--init-method", init)
    try:
        driver.wait_line("STARTED", 60.0)
        os.kill(workers[0].pid, signal.SIGSTOP)  # only the PID we started
        driver.send("STOPPED")
        code, obs = driver.result(90.0)
    finally:
        driver.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[0].pid, signal.SIGCONT)
        stop_workers(workers, timeout=15.0)
    obs.update(code=code, logs=driver.text() + "".join(w.log() for w in workers))
    return obs


def test_Heartbeat_defaults_find_a_stopped_peer_by_silence_and_an_unanswered_probe(
    hung_by_default: dict[str, Any],
) -> None:
    obs = hung_by_default
    assert obs["code"] == 0, obs["logs"]
    assert obs["running_on_w1"] is True
    assert obs["checked"] is True
    assert obs["stdin"] == "STOPPED"
    error = obs["pending"]["error"]
    assert error is not None, obs["pending"]
    assert error["type"] == "PeerLostError", obs["pending"]
    assert "did not answer a probe" in error["message"], error
    assert obs["pending_evidence"] == "silence"
    # 1.25 s of silence, a look every 0.31 s, a 1 s probe: about 2.5 s at most. The bound here is
    # wider for a loaded machine; the figure itself is in the closing notes.
    assert obs["detected_after"] < 6.0, obs["detected_after"]
    assert obs["probes_unanswered"] >= 1


def test_Heartbeat_defaults_keep_a_peer_whose_loop_is_blocked_but_whose_process_answers(
    hung_by_default: dict[str, Any],
) -> None:
    obs = hung_by_default
    # w3's loop spun for 4 s in an @inline function, silent past heartbeat_timeout: its
    # process answered the probe, so it was not lost, and its call returned.
    blocked = obs["blocked_w3"]
    assert (blocked["value"], blocked["error"]) == (4.0, None), blocked
    assert obs["lost_peers"] == ["w1"], obs["logs"]
    assert obs["liveness_probes"] >= 2  # w1's and w3's at least
    assert obs["shutdown"]["error"] is None, obs["shutdown"]


def test_a_loss_is_told_once_to_each_kind_of_watcher(hung_by_default: dict[str, Any]) -> None:
    obs = hung_by_default
    assert obs["losses"] == [["w1", "silence"]]
    assert obs["owner_lost"] == ["silence"]  # RRef.on_owner_lost of w1's RRef
    assert obs["events"] == [["lost", "w1", "silence"]]  # asyncrpc.membership()
    # w2 served a call from w1 and watched it (on_caller_lost): its own heartbeat found
    # w1 gone too.
    assert obs["w2_caller_losses"] == [["w1", "silence"]]
