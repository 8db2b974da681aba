"""A parameter server launched with ``torchrun`` on several hosts, and an elastic restart.

The hosts are network namespaces of our own (``netns.hosts``: root and iproute2, else the
multi-host test skips and the elastic one runs on one host). Each host runs ``torchrun
--nnodes 2 --nproc-per-node 2`` with the c10d rendezvous, as on a real cluster; the program
is ``torchrun_ps.py``: RRefs to shards on every host, distributed autograd across them.
Under ``--max-restarts 1`` a trainer is SIGKILLed before step 7; torchrun restarts the group,
asyncrpc joins again (a fresh store per attempt: none of the first attempt's keys), the
program resumes from its step-6 checkpoint and ends with the weights of an undisturbed run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrpc.testing import free_port
from tests.integration import netns, torchrun_ps

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "integration" / "torchrun_ps.py"
STEPS, NODES, PER_NODE = 12, 2, 2


def reference_weights() -> list[list[torch.Tensor]]:
    """The same training on one process, without RPC: what every run must end with."""
    shards = [torchrun_ps.Shard(r, None) for r in range(1, NODES * PER_NODE)]
    params = [p for shard in shards for p in shard.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    for step in range(STEPS):
        x, target = torchrun_ps.batch(step)
        for shard in shards:
            x = shard(x)
        optimizer.zero_grad()
        (x - target).pow(2).mean().backward()
        optimizer.step()
    return [[p.detach() for p in shard.parameters()] for shard in shards]


def _torchrun(node_args: list[str], env: dict[str, str], prefix: list[str], log: Path) -> Any:
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", *node_args,
           "--max-restarts", "1", str(PROGRAM)]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


@contextlib.contextmanager
def _hosts() -> Iterator[list[netns.Host] | None]:
    if netns.unavailable() is not None:
        yield None
        return
    with netns.hosts(NODES) as found:
        yield found


def run_ps(
    tmp: Path, hosts: list[netns.Host] | None, kill_at: int = -1, store_on: int = 0
) -> tuple[list[int], str]:
    """Run the program on ``hosts`` (None: one host, --standalone), the rendezvous on host
    ``store_on``; exit codes and logs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "PS_DIR": str(tmp),
           "PS_STEPS": str(STEPS), "PS_KILL_AT": str(kill_at)}  # fmt: skip
    procs = []
    if hosts is None:
        one = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(NODES * PER_NODE)]
        procs.append(_torchrun(one, env, [], tmp / "node0.log"))
    else:
        # The rendezvous is hosted on host ``store_on``; node ranks follow the agents' PIDs,
        # so host 0 holds rank 0 either way (both cases are tested).
        endpoint = f"{hosts[store_on].address}:{free_port()}"
        run_id = uuid.uuid4().hex[:8]
        for i, host in enumerate(hosts):
            node = ["--nnodes", str(NODES), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(i == store_on)}",
                    "--local-addr", host.address, "--nproc-per-node", str(PER_NODE)]  # fmt: skip
            node_env = {**env, "RPC_ADVERTISE_HOST": host.address}
            procs.append(_torchrun(node, node_env, host.exec_prefix(), tmp / f"node{i}.log"))
    try:
        codes = [p.wait(360) for p in procs]
    finally:
        for p in procs:  # only the launchers we started; they stop their own workers
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return codes, "".join(f.read_text(errors="replace") for f in sorted(tmp.glob("node*.log")))


def _assert_final(tmp: Path, logs: str) -> None:
    final = torch.load(tmp / "final.pt")
    for got, want in zip(final, reference_weights(), strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m: f"{m}\n{logs[-3000:]}")


def test_torchrun_parameter_server_across_hosts(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with netns.hosts(NODES) as hosts:
        codes, logs = run_ps(tmp_path, hosts)
    assert codes == [0] * NODES, logs
    assert f"PS done {STEPS} steps on {NODES * PER_NODE} workers, attempt 0" in logs, logs
    _assert_final(tmp_path, logs)


def test_torchrun_elastic_restart_resumes_from_checkpoint_with_equal_weights(
    tmp_path: Path,
) -> None:
    with _hosts() as hosts:
        # The rendezvous on the last host: rank 0, on host 0, is not where MASTER_ADDR points.
        codes, logs = run_ps(tmp_path, hosts, kill_at=7, store_on=NODES - 1)
    assert codes == [0] * len(codes), logs
    assert "PS attempt 1 resumes at step 6" in logs, logs
    assert f"PS done {STEPS} steps on {NODES * PER_NODE} workers, attempt 1" in logs, logs
    assert sorted(p.name for p in tmp_path.glob("start-*")) == ["start-0", "start-1"]
    _assert_final(tmp_path, logs)
