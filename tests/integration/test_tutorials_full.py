"""The programs of pytorch/examples ``distributed/rpc`` at their own default lengths
(``--full``: episodes, epochs, batches and world sizes as upstream; synthetic data where
the upstream downloads a data set), each run with ``torch.distributed.rpc`` and with
asyncrpc, the import being the only change, and their results compared as in
``test_tutorials.py``. Minutes each, so outside ``make test``: ``make examples-torch``.

The two runs go one after the other, not at once as in ``test_tutorials.py``: on two
cores, each would slow the other and their wall times would say nothing. With
``EXAMPLES_REPORT=FILE`` each run's wall and CPU time is appended to FILE (JSON lines).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.integration.tutorials.common import IMPLS, run_program

pytestmark = pytest.mark.examples_full
EXACT = {"rtol": 0.0, "atol": 0.0}
SPLIT_SIZES = (1, 2, 4, 8)  # the upstream pipeline's micro-batch sizes, one job each


def _run_both(
    name: str, tmp_path: Path, timeout: float, argv: tuple[str, ...] = ()
) -> tuple[dict[int, Any], ...]:
    """Run the program at full length with each implementation in turn (torch first)."""
    results, seconds, cpu = [], {}, {}
    for impl in IMPLS:
        start, cpu_start = time.monotonic(), _children_cpu()
        results.append(run_program(name, impl, tmp_path / impl, timeout, ("--full", *argv)))
        seconds[impl] = round(time.monotonic() - start, 1)
        cpu[impl] = round(_children_cpu() - cpu_start, 1)
    report = os.environ.get("EXAMPLES_REPORT")
    if report:
        line = {"program": " ".join((name, *argv)), "seconds": seconds, "cpu_seconds": cpu}
        with open(report, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
    return tuple(results)


def _children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for descendants: the program
    and its ranks (each waited for by its parent), which a loaded VM moves far less than
    their wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _assert_trained(initial: list[torch.Tensor], final: list[torch.Tensor]) -> None:
    assert len(initial) == len(final) > 0
    assert all(not torch.equal(a, b) for a, b in zip(initial, final, strict=True))


@pytest.mark.timeout(3600)
def test_Rl_runs_until_solved_as_torch(tmp_path: Path) -> None:
    # Exact: one observer, so every call on the agent (and every dropout mask and action
    # drawn there) comes in one order.
    torch_run, ours = _run_both("reinforce", tmp_path, timeout=1500)
    assert torch_run[0]["solved"], "torch's run never passed the reward threshold"
    assert_close(ours, torch_run, **EXACT)
    assert ours[0]["running_rewards"][-1] > 475.0


@pytest.mark.parametrize("mode", ["batch", "single"])
@pytest.mark.timeout(1200)
def test_BatchRl_ten_episodes_match_torch(tmp_path: Path, mode: str) -> None:
    # Exact: one observer, its calls answered in the order they come.
    torch_run, ours = _run_both("batch_reinforce", tmp_path, 500, ("--mode", mode))
    assert_close(ours, torch_run, **EXACT)
    assert len(ours[0]["rewards"]) == 10
    _assert_trained(ours[0]["initial"], ours[0]["final"])


@pytest.mark.timeout(1200)
def test_BatchParameterServer_five_trainers_match_torch(tmp_path: Path) -> None:
    # Within rounding: five trainers add their gradients in the order they come.
    torch_run, ours = _run_both("batch_ps", tmp_path, timeout=500)
    assert_close(ours, torch_run)
    assert len(ours[0]["losses"]) == 5
    assert all(losses.shape == (6,) for losses in ours[0]["losses"].values())
    _assert_trained(ours[0]["initial"], ours[0]["final"])


@pytest.mark.timeout(2400)
def test_ParameterServer_one_pass_over_mnist_sized_set_matches_torch(tmp_path: Path) -> None:
    # Exact: the trainers take turns on the server (see the program's docstring).
    torch_run, ours = _run_both("parameter_server", tmp_path, timeout=1000)
    assert_close(ours, torch_run, **EXACT)
    assert all(ours[trainer]["losses"].shape == (1875,) for trainer in (1, 2, 3))
    _assert_trained(ours[0]["initial"], ours[0]["final"])


@pytest.mark.timeout(1200)
def test_Rnn_ten_epochs_match_torch(tmp_path: Path) -> None:
    torch_run, ours = _run_both("rnn", tmp_path, timeout=500)
    assert_close(ours, torch_run, **EXACT)
    assert ours[1]["losses"].shape == (50,)
    _assert_trained(ours[1]["initial"], ours[1]["final"])


@pytest.mark.timeout(2400)
def test_DdpRpc_hundred_epochs_match_torch(tmp_path: Path) -> None:
    # Exact: the trainers step the shared table in turn (see the program's docstring).
    torch_run, ours = _run_both("ddp_rpc", tmp_path, timeout=1000)
    master, torch_master = ours[2], torch_run[2]
    assert_close(master, torch_master, **EXACT)
    assert_close(master["trainers"][0]["fc"], master["trainers"][1]["fc"], **EXACT)
    assert all(t["losses"].shape == (1000,) for t in master["trainers"])
    _assert_trained(master["initial"], master["final"])


@pytest.mark.parametrize("split", SPLIT_SIZES)
@pytest.mark.timeout(1200)
def test_Pipeline_three_batches_match_torch(tmp_path: Path, split: int) -> None:
    # Within rounding: the shards run micro-batches in the order they come.
    torch_run, ours = _run_both("pipeline", tmp_path, 500, ("--split", str(split)))
    assert_close(ours, torch_run)
    assert ours[0]["losses"].shape == (3,)
    _assert_trained(ours[0]["initial"], ours[0]["final"])
