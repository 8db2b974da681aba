"""Start-up mistakes name their cause on every member they affect, within a bounded time:
differing world sizes, and rank 0 (the TCPStore's host) leaving during or right after
start-up. Each member is a ``startup`` scenario process, killed in ``finally``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from asyncrpc.testing import free_port
from tests import scenarios

pytestmark = pytest.mark.timeout(90)

# Far below the 20 s rendezvous bound every member gets: an error seen only after a timeout
# fails the test through ``elapsed``; ``result`` fails one that never ends at all.
_PROMPT_S = 8.0


@contextmanager
def _members(
    specs: Sequence[Sequence[str]], envs: Sequence[dict[str, str] | None] | None = None
) -> Iterator[list[scenarios.ScenarioProcess]]:
    procs: list[scenarios.ScenarioProcess] = []
    try:
        for spec, env in zip(specs, envs or [None] * len(specs), strict=True):
            procs.append(scenarios.start("startup", *spec, env=env))
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def _results(specs: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    with _members(specs) as procs:
        return [proc.result(40.0)[1] for proc in procs]


def _error_type(obs: dict[str, Any]) -> str | None:
    error = obs["init"]["error"]
    return None if error is None else str(error["type"])


def _spec(init: str, name: str, rank: int, world_size: int, *extra: str) -> list[str]:
    return ["--init-method", init, "--name", name, "--rank", str(rank),
            "--world-size", str(world_size), "--rpc-timeout", "20", *extra]  # fmt: skip


@pytest.mark.parametrize(("size0", "size1"), [(2, 3), (3, 2)], ids=["rank1-bigger", "rank0-bigger"])
def test_init_rpc_world_size_mismatch_raises_on_every_rank(size0: int, size1: int) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    results = _results([_spec(init, "m0", 0, size0), _spec(init, "m1", 1, size1)])
    assert [_error_type(obs) for obs in results] == ["WorldSizeMismatchError"] * 2, results
    for obs in results:
        error = obs["init"]["error"]
        assert "ValueError" in error["mro"]
        assert "InitError" in error["mro"]
        # Both ranks and both values, whoever saw the difference first.
        assert error["message"].removeprefix("world_size differs between ranks: ") in {
            f"rank 1 says world_size={size1}, rank 0 says {size0}",
            f"rank 0 says world_size={size0}, rank 1 says {size1}",
        }, error
        assert obs["init"]["elapsed"] < _PROMPT_S, results


def test_init_rpc_world_size_mismatch_under_env_rendezvous() -> None:
    port = str(free_port())
    envs = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": size}
        for rank, size in ((0, "3"), (1, "2"))
    ]
    specs = [["--init-method", "env://", "--name", f"m{r}", "--rpc-timeout", "20"] for r in (0, 1)]
    with _members(specs, envs) as procs:
        results = [proc.result(40.0)[1] for proc in procs]
    assert [_error_type(obs) for obs in results] == ["WorldSizeMismatchError"] * 2, results
    assert all(obs["init"]["elapsed"] < _PROMPT_S for obs in results), results


def test_init_rpc_a_rank_never_started_is_named_on_every_rank() -> None:
    # Rank 2 of 3 never comes. Rank 0 gives up first (its bound is shorter) and would take
    # its store with it: rank 1 still hears which rank is missing, not that the store
    # died, and no C++ stack reaches anyone's stderr.
    init = f"tcp://127.0.0.1:{free_port()}"
    specs = [_spec(init, "m0", 0, 3), _spec(init, "m1", 1, 3)]
    specs[0][specs[0].index("--rpc-timeout") + 1] = "2"
    with _members(specs) as procs:
        results = [proc.result(40.0)[1] for proc in procs]
        texts = [proc.text() for proc in procs]
    assert [_error_type(obs) for obs in results] == ["RendezvousTimeoutError"] * 2, texts
    for obs in results:
        error = obs["init"]["error"]
        assert "TimeoutError" in error["mro"]
        assert "InitError" in error["mro"]
        assert "rank 2 of world_size=3 never came" in error["message"], error
    # Rank 1 (bound 20 s) learns it from rank 0 at once, not from its own timeout.
    assert results[1]["init"]["elapsed"] < results[0]["init"]["elapsed"] + _PROMPT_S, results
    assert scenarios.cpp_log_lines("".join(texts)) == []


def test_init_rpc_store_host_failing_at_once_still_tells_the_others() -> None:
    # Rank 0 compares sizes last (it waits for rank 1's to be recorded), so it is the one to
    # see the difference; it then exits at once, without teardown. Its store must stay up
    # until rank 1 has read the cause: rank 1 hears the mismatch, not "store gone".
    init = f"tcp://127.0.0.1:{free_port()}"
    specs = [
        _spec(init, "m0", 0, 3, "--claim-last", "--exit-at-once"),
        _spec(init, "m1", 1, 2),
    ]
    results = _results(specs)
    assert [_error_type(obs) for obs in results] == ["WorldSizeMismatchError"] * 2, results
    assert "rank 0 says world_size=3, rank 1 says 2" in results[0]["init"]["error"]["message"]
    assert all(obs["init"]["elapsed"] < _PROMPT_S for obs in results), results


def test_init_rpc_store_host_leaving_right_after_start_breaks_no_start() -> None:
    # Rank 0 ends its process the moment init_rpc returns. Every other member still starts
    # (rank 0 returned only once all had read the group), then hears, typed and at once,
    # that rank 0 is gone: its shutdown is a ShutdownError. Its call races with rank 0's
    # exit: answered if it got there first, else failed as a lost peer, never untyped.
    init = f"tcp://127.0.0.1:{free_port()}"
    specs = [_spec(init, "m0", 0, 3, "--exit-after-init")]
    specs += [_spec(init, f"m{r}", r, 3, "--call", "m0") for r in (1, 2)]
    with _members(specs) as procs:
        results = [proc.result(40.0)[1] for proc in procs]
        texts = [proc.text() for proc in procs]
    assert all(_error_type(obs) is None for obs in results), results
    for obs in results[1:]:
        call = obs["calls"]["m0"]
        assert (call["error"] is None) != (call["value"] is None), obs
        if call["error"] is not None:
            assert "ConnectionError" in call["error"]["mro"], obs
        assert obs["shutdown"]["error"]["type"] == "ShutdownError", obs
        # The worker that is gone is named, not only its store.
        assert "worker 'm0' (rank 0) is gone" in obs["shutdown"]["error"]["message"], obs
        assert obs["shutdown"]["elapsed"] < _PROMPT_S, obs
    # m0 is gone for good: nobody says a reconnect will follow, and torch's C++ store
    # client logs no stack on anyone's stderr.
    assert not any("the next call reconnects" in text for text in texts), texts
    assert scenarios.cpp_log_lines("".join(texts)) == []


def test_init_rpc_refuses_a_device_map_naming_a_missing_gpu() -> None:
    # Checked before joining: this machine's torch sees no CUDA device (or fewer than 99).
    code = (
        "import asyncrpc, sys\n"
        "options = asyncrpc.RpcBackendOptions(init_method=sys.argv[1],"
        " device_maps={'other': {98: 0}})\n"
        "try:\n"
        "    asyncrpc.init_rpc('alone', rank=0, world_size=1, rpc_backend_options=options)\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    init = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-c", code, init], check=False, capture_output=True, text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DeviceMapError"), done.stdout + done.stderr
    assert "cuda:98" in done.stdout
