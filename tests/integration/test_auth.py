"""Authentication with real worker processes: only peers holding the group key get in,
and nothing from anyone else is ever unpickled."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

pytestmark = pytest.mark.timeout(120)


def test_auth_strangers_are_refused_and_nothing_is_unpickled(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    marker = tmp_path / "pwned"
    good, bad = {"ASYNCRPC_AUTH_KEY": "the group key"}, {"ASYNCRPC_AUTH_KEY": "another key"}
    workers = [
        spawn_worker("a1", 1, 3, init, log_dir=tmp_path, env=good, rpc_timeout=20.0,
                     shutdown_timeout=5.0, extra_args=["--handshake-timeout", "1"]),
        spawn_worker("a2", 2, 3, init, log_dir=tmp_path, env=bad, rpc_timeout=20.0,
                     shutdown_timeout=5.0),
    ]  # fmt: skip
    try:
        driver = scenarios.start(
            "auth_attacks", "--init-method", init, "--marker", str(marker), env=good
        )
        try:
            code, out = driver.result(90.0)
        finally:
            driver.kill()
        assert code == 0, driver.text()
    finally:
        stop_workers(workers, timeout=5)
    assert out["a1_add"] == 5
    assert out["challenged"] is True  # the claimed name was a real one: a1 challenged it
    assert out["wrong_proof_closed"] is True
    assert out["no_handshake_closed"] is True
    assert out["big_hello_closed"] is True
    assert out["idle_closed"] is True
    assert out["marker_exists"] is False  # no payload was ever unpickled
    assert out["a1_auth_failures"] >= 2  # the wrong proof and the idle connection
    assert out["a1_still_serves"] is True
    assert out["a2_error"] == "PeerUnavailableError"  # a2 cannot prove our key
    assert out["a0_auth_failures"] >= 1
    log = (tmp_path / "a1.log").read_text()
    assert log.count("refused a connection") == 1  # rate-limited: one line, not four
