"""Issue 15 with real worker processes: nested blocking calls deeper than the pool,
frame limits known to both sides, connections that drop and heal, bounded shutdown.

Each scenario runs in a driver process of its own (``heal_scenarios.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests.integration import scenarios

pytestmark = pytest.mark.timeout(120)
_IMPORT = ["--import", "tests.integration.remote_fns"]


def run_scenario(
    name: str,
    tmp_path: Path,
    workers: Sequence[tuple[str, Sequence[str]]],
    *args: str,
    timeout: float = 90.0,
) -> dict[str, Any]:
    """Start ``workers`` (name, extra CLI args) as ranks 1.., run scenario ``name`` as rank 0;
    return its observations with ``code``, ``worker_codes`` and ``logs``."""
    init = f"tcp://127.0.0.1:{free_port()}"
    size = len(workers) + 1
    procs = [
        spawn_worker(n, r + 1, size, init, log_dir=tmp_path, rpc_timeout=20.0,
                     shutdown_timeout=20.0, extra_args=[*_IMPORT, *extra])
        for r, (n, extra) in enumerate(workers)
    ]  # fmt: skip
    driver = scenarios.start(
        name, "--init-method", init, "--world-size", str(size), *args,
        module="tests.integration.heal_scenarios",
    )  # fmt: skip
    try:
        code, obs = driver.result(timeout)
    finally:
        driver.kill()
        codes = stop_workers(procs, timeout=20.0)
    obs.update(code=code, worker_codes=codes, logs=driver.text() + "".join(p.log() for p in procs))
    return obs


# -- nested blocking calls ------------------------------------------------------------------


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    four = ["--threads", "4"]
    capped = [*four, "--max-threads", "4"]
    workers = [("n1", four), ("n2", four), ("n3", capped), ("n4", capped)]
    return run_scenario("nested", tmp_path_factory.mktemp("nested"), workers)


def test_WorkerPool_nested_chain_of_32_completes_on_4_threads(nested: dict[str, Any]) -> None:
    assert nested["code"] == 0, nested["logs"]
    assert nested["deep"]["error"] is None, nested["deep"]
    assert nested["deep"]["value"] == 32


def test_WorkerPool_eight_nested_chains_of_8_complete_on_4_threads(
    nested: dict[str, Any],
) -> None:
    assert nested["eight"]["error"] is None, nested["eight"]
    assert nested["eight"]["value"] == [8] * 8


def test_WorkerPool_at_its_cap_fails_typed_instead_of_hanging(nested: dict[str, Any]) -> None:
    error = nested["capped"]["error"]
    assert error is not None, nested["capped"]
    assert error["type"] == "ThreadPoolExhaustedError"
    assert nested["capped_after"]["value"] == 2  # the pair still works
    assert (
        nested["metrics"]["n3"]["thread_pool_refused"]
        + nested["metrics"]["n4"]["thread_pool_refused"]
        >= 1
    )


def test_WorkerPool_stand_in_threads_exit_once_the_chains_are_done(
    nested: dict[str, Any],
) -> None:
    assert nested["threads_back"] is True, nested["metrics"]
    for name in ("n1", "n2"):
        assert nested["metrics"][name]["thread_pool_blocked"] == 0
    assert nested["shutdown"]["error"] is None, nested["shutdown"]
    assert nested["worker_codes"] == [0, 0, 0, 0], nested["logs"]


# -- frame limits known to both sides ------------------------------------------------------


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workers = [("m1", ["--max-frame-size", str(1 << 20)])]
    return run_scenario("frames", tmp_path_factory.mktemp("frames"), workers)


def test_Agent_oversized_request_fails_at_the_sender_before_any_byte(
    frames: dict[str, Any],
) -> None:
    assert frames["code"] == 0, frames["logs"]
    error = frames["send_big"]["error"]
    assert error is not None, frames["send_big"]
    assert error["type"] == "FrameTooLargeError"
    assert error["worker"] == "m1"
    assert str(1 << 20) in error["message"]  # names the limit (a detail)
    assert frames["bytes_written"] == 0


def test_Agent_oversized_reply_fails_typed_at_the_callee(frames: dict[str, Any]) -> None:
    error = frames["reply_big"]["error"]
    assert error is not None, frames["reply_big"]
    assert error["type"] == "FrameTooLargeError"
    assert error["worker"] == "driver"


def test_Agent_oversized_messages_leave_the_connection_untouched(frames: dict[str, Any]) -> None:
    assert frames["send_half"]["value"] == (1 << 20) // 2, frames["send_half"]
    assert frames["reply_half"]["value"] == (1 << 20) // 2, frames["reply_half"]
    assert frames["connections_lost"] == 0
    assert frames["connections_opened"] == 1
    assert frames["m1_metrics"]["connections_lost"] == 0
    assert frames["shutdown"]["error"] is None, frames["shutdown"]
    assert frames["worker_codes"] == [0], frames["logs"]
