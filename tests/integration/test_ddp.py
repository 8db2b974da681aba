"""DDP inside distributed autograd, with real processes over 127.0.0.1: hybrid DDP + RPC
training gives single-process training's losses and weights step by step (even and uneven
inputs), and concurrent contexts on one worker keep their gradients apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.testing import free_port
from tests import scenarios
from tests.scenarios import ddp as scenario

pytestmark = pytest.mark.timeout(120)


def run_ranks(argvs: list[list[str]], timeout: float = 90.0) -> list[scenarios.Observations]:
    """Start one scenario process per argv, wait for all (bounded), kill any left; fail
    with their output if one did not exit 0. Returns each one's observations."""
    procs: list[scenarios.ScenarioProcess] = []
    try:
        procs.extend(scenarios.start(*argv) for argv in argvs)
        results = [proc.result(timeout) for proc in procs]
        codes = [code for code, _ in results]
    finally:
        for proc in procs:
            proc.kill()
    text = "\n".join(
        f"--- {argv[0]}\n{proc.text()[-3000:]}" for argv, proc in zip(argvs, procs, strict=True)
    )
    assert codes == [0] * len(argvs), text
    return [observed for _, observed in results]


def hybrid(tmp_path: Path, steps: tuple[int, int]) -> dict[str, Any]:
    common = ["--init-method", f"tcp://127.0.0.1:{free_port()}", "--pg-port", str(free_port())]
    common += ["--steps", f"{steps[0]},{steps[1]}"]
    outs = [tmp_path / f"out{rank}.pt" for rank in range(3)]
    run_ranks(
        [
            ["ddp_hybrid", *common, "--rank", str(rank), "--out", str(out)]
            for rank, out in enumerate(outs)
        ]
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
        [
            ["ddp_concurrent", "--init-method", init_method, "--pg-port", str(free_port()),
             "--out", str(out)],
            ["ddp_serve", "--init-method", init_method],
        ]
    )  # fmt: skip
    got = torch.load(out)
    want = scenario.concurrent_reference()
    assert sorted(got["grads"]) == list(range(scenario.THREADS))
    for trainer, grads in got["grads"].items():
        for mine, ref in zip(grads, want[trainer], strict=True):
            torch.testing.assert_close(mine, ref)
    assert got["grad_set"] == [False, False]  # never into .grad


def test_DdpUnderDistAutograd_module_dropped_after_its_group_never_hangs() -> None:
    """torch's reducer drops its group's last reference where the program drops the DDP
    module: after ``destroy_process_group`` it would tear the group down there, holding
    the GIL and waiting for gloo's threads; one of them needing the GIL (to let go of a
    tensor made in Python) hangs the program for good. Here rank 0 drops its module with
    an all-reduce in flight that rank 1 joins only when rank 0 has gone on: with the
    group torn down on rank 0's thread, rank 0 never goes on (the test times out)."""
    common = ["--init-method", f"tcp://127.0.0.1:{free_port()}", "--pg-port", str(free_port())]
    d0, d1 = run_ranks(
        [["ddp_teardown", *common, "--rank", str(rank)] for rank in range(2)], timeout=60.0
    )
    assert d1["took_part"] is True
    assert d0["let_go"] is True  # and asyncrpc lets the group go afterwards
