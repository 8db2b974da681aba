"""Starting groups for real: rendezvous variants, duplicates, torch's options, asyncio style.

Every group here is its own: members run ``scenarios`` (``member``, ``asyncio_style``...) in
separate processes beside workers from ``spawn_worker``, all stopped in ``finally``.
"""

from __future__ import annotations

import datetime
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from asyncrpc.testing import WorkerProcess, free_port, spawn_worker, stop_workers
from tests import scenarios

pytestmark = pytest.mark.timeout(60)

Result = tuple[int, dict[str, Any]]


@contextmanager
def _started(
    runs: Sequence[tuple[str, Sequence[str], dict[str, str] | None]],
    workers: Sequence[WorkerProcess] = (),
) -> Iterator[list[scenarios.ScenarioProcess]]:
    """Start scenario processes (name, args, env); kill them and ``workers`` on exit."""
    procs: list[scenarios.ScenarioProcess] = []
    try:
        for name, args, env in runs:
            procs.append(scenarios.start(name, *args, env=env))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        stop_workers(workers, timeout=10.0)


def _members(
    specs: Sequence[Sequence[str]], envs: Sequence[dict[str, str] | None] | None = None
) -> list[Result]:
    """Run one ``member`` scenario per spec, all at once; return each (exit code, result)."""
    envs = envs or [None] * len(specs)
    with _started([("member", spec, env) for spec, env in zip(specs, envs, strict=True)]) as ps:
        return [proc.result(30.0) for proc in ps]


def _init_error(obs: dict[str, Any]) -> str | None:
    error = obs["init"]["error"]
    return None if error is None else str(error["type"])


@pytest.mark.parametrize(
    ("world_size", "members", "expected"),
    [
        (2, [("dup", 0), ("dup", 1)], "DuplicateNameError"),
        # World of 3 with rank 2 missing: the group can never complete, so the members that
        # claimed first cannot finish joining before the duplicate is detected.
        (3, [("driver", 0), ("w1", 1), ("w1b", 1)], "DuplicateRankError"),
    ],
    ids=["duplicate-name", "duplicate-nonzero-rank"],
)
def test_init_rpc_duplicate_fails_on_every_member_without_hanging(
    world_size: int, members: list[tuple[str, int]], expected: str
) -> None:
    # rpc_timeout bounds the rendezvous (asyncrpc/runtime/agent.py _join): 5 s here.
    common = ["--init-method", f"tcp://127.0.0.1:{free_port()}", "--rpc-timeout", "5"]
    common += ["--world-size", str(world_size)]
    results = _members([[*common, "--name", name, "--rank", str(rank)] for name, rank in members])
    assert all(code == 1 for code, _ in results), results
    errors = [_init_error(obs) for _, obs in results]
    assert errors == [expected] * len(members), results  # every member hears the cause
    # Whoever detects the duplicate aborts the group, so all fail well within the 5 s bound
    # (typically < 0.5 s); the slack is for a loaded machine.
    assert all(obs["init"]["elapsed"] < 6.0 for _, obs in results), results


def test_init_rpc_store_host_dying_mid_rendezvous_raises_store_host_lost() -> None:
    import torch.distributed as dist

    port = free_port()
    common = ["--init-method", f"tcp://127.0.0.1:{port}", "--world-size", "3"]
    runs = [
        ("member", [*common, "--name", "host", "--rank", "0", "--rpc-timeout", "20"], None),
        ("member", [*common, "--name", "w1", "--rank", "1", "--rpc-timeout", "20"], None),
    ]  # rank 2 never comes: both wait in the rendezvous
    with _started(runs) as (host, member):
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20)
        )
        deadline = time.monotonic() + 20.0
        while not client.check(["asyncrpc/rank/1"]):  # w1 has published: it is waiting
            assert time.monotonic() < deadline, member.text()
            time.sleep(0.05)
        del client
        host.kill()  # SIGKILL by the PID we started: the store goes away
        code, obs = member.result(20.0)
    assert code == 1, member.text()
    assert _init_error(obs) == "StoreHostLostError", obs
    assert "InitError" in obs["init"]["error"]["mro"]
    assert "Exception raised from" not in obs["init"]["error"]["message"]  # no C++ stack
    assert scenarios.cpp_log_lines(member.text()) == []  # nor on stderr


@pytest.mark.parametrize("names_from", ["torch", "asyncrpc"])
def test_init_rpc_accepts_torch_tensorpipe_options(tmp_path: Path, names_from: str) -> None:
    """torch's options class and backend enum, from torch or under asyncrpc's names of them
    (``rpc.TensorPipeRpcBackendOptions`` after ``import asyncrpc as rpc``)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=tmp_path, rpc_timeout=10.0,
                          shutdown_timeout=10.0)  # fmt: skip
    args = ["--init-method", init, "--name", "driver", "--rank", "0", "--world-size", "2"]
    args += ["--torch-options", "--names-from", names_from, "--rpc-timeout", "7.5"]
    args += ["--call", "w1", "--call", "driver"]
    with _started([("member", args, None)], [worker]) as (driver,):
        code, obs = driver.result(30.0)
        assert stop_workers([worker], timeout=10.0) == [0], worker.log()
    assert code == 0, driver.text()
    assert obs["rpc_timeout"] == 7.5
    assert obs["thread_pool_size"] == 8
    assert obs["calls"]["w1"]["value"] == worker.pid
    assert obs["calls"]["driver"]["value"] == obs["pid"]
    assert obs["shutdown"]["error"] is None


def _assert_pair_worked(results: list[Result]) -> None:
    pids = {f"m{rank}": obs.get("pid") for rank, (_, obs) in enumerate(results)}
    for rank, (code, obs) in enumerate(results):
        assert code == 0, results
        assert obs["rank"] == rank
        assert obs["world"] == ["m0", "m1"]
        assert {peer: call["value"] for peer, call in obs["calls"].items()} == pids, results
        assert obs["shutdown"]["error"] is None


def test_init_rpc_env_rendezvous() -> None:
    port = str(free_port())
    envs = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": "2"}
        for r in range(2)
    ]
    specs = [["--init-method", "env://", "--name", f"m{r}", "--call", "m0", "--call", "m1"]
             for r in range(2)]  # fmt: skip
    _assert_pair_worked(_members(specs, envs))


def test_init_rpc_file_rendezvous(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    specs = [
        ["--init-method", init, "--name", f"m{r}", "--rank", str(r), "--world-size", "2",
         "--call", "m0", "--call", "m1"]
        for r in range(2)
    ]  # fmt: skip
    _assert_pair_worked(_members(specs))


def test_init_rpc_agent_is_current_before_it_serves_requests(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    common = ["--init-method", init, "--world-size", "2", "--call-fn", "whoami"]
    specs = [
        [*common, "--name", "m0", "--rank", "0", "--call", "m1"],
        [*common, "--name", "m1", "--rank", "1", "--call", "m0", "--slow-register", "1.5"],
    ]
    (code0, caller), (code1, late) = _members(specs)
    assert (code0, code1) == (0, 0), (caller, late)
    assert late["calls"]["m0"]["value"] == "m0"
    assert caller["calls"]["m1"]["error"] is None, caller["calls"]
    assert caller["calls"]["m1"]["value"] == "m1"


@pytest.fixture(scope="module")
def asyncio_style(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run ``asyncio_style`` (driver under ``async with asyncrpc.worker``) beside worker w1."""
    init = f"tcp://127.0.0.1:{free_port()}"
    log_dir = tmp_path_factory.mktemp("asyncio")
    worker = spawn_worker("w1", 1, 2, init, log_dir=log_dir, rpc_timeout=10.0,
                          shutdown_timeout=10.0)  # fmt: skip
    runs = [("asyncio_style", ["--init-method", init], None)]
    with _started(runs, [worker]) as (driver,):
        code, obs = driver.result(30.0)
        worker_code = stop_workers([worker], timeout=10.0)[0]
    return {**obs, "code": code, "worker_code": worker_code, "logs": driver.text() + worker.log()}


def test_worker_runs_the_agent_on_the_programs_loop(asyncio_style: dict[str, Any]) -> None:
    obs = asyncio_style
    assert obs["code"] == 0, obs["logs"]
    assert obs["info"] == ["driver", 0]
    assert obs["agent_on_running_loop"] is True
    assert obs["agent_on_this_thread"] is True
    assert obs["loop_threads"] == []  # no "asyncrpc-driver" loop thread was started
    assert obs["call"] == 42
    assert obs["call_after_thread"] == 3


def test_worker_asyncio_timeout_cancels_the_remote_coroutine(
    asyncio_style: dict[str, Any],
) -> None:
    assert asyncio_style["timeout_error"]["type"] == "TimeoutError"
    assert asyncio_style["remote_cancelled"] is True


def test_worker_blocking_rpc_sync_on_its_loop_raises(asyncio_style: dict[str, Any]) -> None:
    error = asyncio_style["blocking_on_loop"]["error"]
    assert error is not None, asyncio_style
    assert error["type"] == "BlockingCallError"
    assert asyncio_style["blocking_on_loop"]["elapsed"] < 1.0


def test_worker_rpc_sync_from_a_thread_and_clean_exit(asyncio_style: dict[str, Any]) -> None:
    assert asyncio_style["from_thread"] == 5
    assert asyncio_style["shut_down"]["type"] == "NotInitializedError"
    assert asyncio_style["worker_code"] == 0, asyncio_style["logs"]
    assert asyncio_style["worker_code"] != -signal.SIGKILL


def test_rpc_sync_before_init_and_after_shutdown_raises_not_initialized() -> None:
    runs = [("not_initialized", ["--init-method", f"tcp://127.0.0.1:{free_port()}"], None)]
    with _started(runs) as (proc,):
        code, obs = proc.result(30.0)
    assert code == 0, proc.text()
    assert obs["before"]["type"] == "NotInitializedError"
    assert "RuntimeError" in obs["before"]["mro"]  # torch raised RuntimeError here
    assert obs["during"] == 3
    assert obs["after"]["type"] == "NotInitializedError"


def test_calls_sent_while_connecting_arrive_in_order(tmp_path: Path) -> None:
    # Calls fired before the first connection exists wait for it; calls fired once it is
    # made must not overtake them (a fetch must never arrive before its remote()).
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=tmp_path, rpc_timeout=10.0,
                          shutdown_timeout=10.0)  # fmt: skip
    with _started([("first_calls_in_order", ["--init-method", init], None)], [worker]) as ps:
        code, obs = ps[0].result(30.0)
    assert code == 0, ps[0].text()
    assert obs["calls"]["error"] is None, obs
    assert obs["arrivals"] == list(range(400))
    assert obs["shutdown"]["error"] is None, obs
