"""DDP inside distributed autograd, with real processes over 127.0.0.1: hybrid DDP + RPC
training gives single-process training's losses and weights step by step (even and uneven
inputs), and concurrent contexts on one worker keep their gradients apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.testing import free_port
from tests.integration import ddp_scenarios as scenario

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(argvs: list[list[str]], tmp_path: Path, timeout: float = 90.0) -> None:
    """Start one process per argv, wait for all (bounded), kill any left; fail with the
    logs if one did not exit 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    logs = [tmp_path / f"rank{i}.log" for i in range(len(argvs))]
    procs = []
    try:
        for argv, log in zip(argvs, logs, strict=True):
            with log.open("w") as sink:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.integration.ddp_scenarios", *argv],
                    stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                ))  # fmt: skip
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0] * len(argvs), text


def hybrid(tmp_path: Path, steps: tuple[int, int]) -> dict[str, Any]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    pg_port = str(free_port())
    outs = [tmp_path / f"out{rank}.pt" for rank in range(3)]
    run_ranks(
        [
            ["hybrid", str(rank), init_method, pg_port, f"{steps[0]},{steps[1]}", str(out)]
            for rank, out in enumerate(outs)
        ],
        tmp_path,
    )
    return {"t1": torch.load(outs[1]), "t2": torch.load(outs[2])}


@pytest.mark.parametrize("steps", [(3, 3), (4, 2)], ids=["even", "uneven-join"])
def test_DdpUnderDistAutograd_matches_single_process_training(
    tmp_path: Path, steps: tuple[int, int]
) -> None:
    got = hybrid(tmp_path, steps)
    want = scenario.reference(steps)
    for trainer in (1, 2):
        torch.testing.assert_close(
            got[f"t{trainer}"]["losses"], want["losses"][trainer], rtol=1e-5, atol=1e-6
        )
        # DDP keeps the trainers' local layers equal, to single-process training's.
        for mine, ref in zip(got[f"t{trainer}"]["local"], want["local"], strict=True):
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    for mine, ref in zip(got["t1"]["shared"], want["shared"], strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


def test_DdpUnderDistAutograd_reference_differs_without_allreduce() -> None:
    """The reference is sensitive to what the test checks: each trainer stepping its local
    layer with its own gradient (no all-reduce, the old bug) ends elsewhere."""
    steps = (3, 3)
    want = scenario.reference(steps)
    shared, local = scenario.make_layers()
    for step in range(steps[0]):
        local.zero_grad()
        shared.zero_grad()
        scenario.loss_of(local(torch.relu(shared(scenario.batch(step, 1))))).backward()
        with torch.no_grad():
            for p in local.parameters():
                p.sub_(scenario.LR * p.grad)  # type: ignore[operator]
    differs = [
        not torch.allclose(mine, ref, rtol=1e-5, atol=1e-6)
        for mine, ref in zip(local.parameters(), want["local"], strict=True)
    ]
    assert any(differs)


def test_DistAutogradContext_concurrent_passes_on_torch_engine_keep_apart(
    tmp_path: Path,
) -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "out.pt"
    run_ranks(
        [["concurrent", init_method, str(free_port()), str(out)], ["serve", init_method]],
        tmp_path,
    )
    got = torch.load(out)
    want = scenario.concurrent_reference()
    assert sorted(got["grads"]) == list(range(scenario.THREADS))
    for trainer, grads in got["grads"].items():
        for mine, ref in zip(grads, want[trainer], strict=True):
            torch.testing.assert_close(mine, ref)
    assert got["grad_set"] == [False, False]  # never into .grad
