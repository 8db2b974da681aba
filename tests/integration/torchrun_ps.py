"""A parameter-server program for ``torchrun`` across hosts, with checkpoints (test layer).

Launch it on every node (see docs/deployment.md); torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Rank 0 ("trainer0") drives; every other rank owns one shard of
the model (a ``Linear`` behind an RRef) and trains in turn: step s runs on trainer
``1 + s % (WORLD_SIZE - 1)``, which sends its batch through every shard (RPCs across hosts),
runs the distributed backward and steps a ``DistributedOptimizer`` over all shards. Steps
run one at a time, so the final weights depend only on the step count (an undisturbed run
and a resumed one end equal).

Environment (beside torchrun's): ``PS_DIR`` (checkpoint and outputs), ``PS_STEPS`` (default
12), ``PS_CKPT_EVERY`` (default 3), ``PS_KILL_AT`` (a step: on rank 0's first start, the
trainer of that step is SIGKILLed just before it), ``RPC_ADVERTISE_HOST`` (this node's address).
Rank 0 writes ``final.pt`` and a line ``PS done ...`` at the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.optim import DistributedOptimizer

WIDTH = 8
_optimizers: dict[int, DistributedOptimizer] = {}  # on each trainer: one, built lazily
_lock = threading.Lock()


class Shard(nn.Module):
    """One shard of the model, owned by one rank."""

    def __init__(self, index: int, weights: list[torch.Tensor] | None) -> None:
        super().__init__()
        torch.manual_seed(100 + index)
        self.linear = nn.Linear(WIDTH, WIDTH)
        if weights is not None:
            with torch.no_grad():
                for param, saved in zip(self.linear.parameters(), weights, strict=True):
                    param.copy_(saved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def forward(shard: asyncrpc.RRef[Shard], x: torch.Tensor) -> torch.Tensor:
    return shard.local_value()(x)


def weights(shard: asyncrpc.RRef[Shard]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in shard.local_value().parameters()]


def param_rrefs(shard: asyncrpc.RRef[Shard]) -> list[asyncrpc.RRef[torch.Tensor]]:
    return [asyncrpc.RRef(p) for p in shard.local_value().parameters()]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, WIDTH, generator=generator), torch.randn(16, WIDTH, generator=generator)


def train_step(shards: list[asyncrpc.RRef[Shard]], step: int) -> float:
    """One step on this trainer: forward through every shard, backward, optimizer step."""
    with _lock:
        if 0 not in _optimizers:
            params: list[asyncrpc.RRef[Any]] = []
            for shard in shards:
                params += asyncrpc.rpc_sync(shard.owner_name(), param_rrefs, args=(shard,))
            _optimizers[0] = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
        optimizer = _optimizers[0]
    x, target = batch(step)
    with dist_autograd.context() as context_id:
        for shard in shards:
            x = asyncrpc.rpc_sync(shard.owner_name(), forward, args=(shard, x))
        loss = (x - target).pow(2).mean()
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return float(loss)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def release_optimizer() -> None:
    _optimizers.clear()


# -- rank 0 -----------------------------------------------------------------------------------


def _load(path: Path) -> tuple[int, list[list[torch.Tensor]] | None]:
    if not path.exists():
        return 0, None
    saved = torch.load(path)
    return int(saved["step"]), saved["weights"]


def _save(path: Path, step: int, shards: list[asyncrpc.RRef[Shard]]) -> None:
    state = {"step": step, "weights": [asyncrpc.rpc_sync(s.owner_name(), weights, args=(s,))
                                       for s in shards]}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill never leaves half a checkpoint


def drive(world: int, out: Path) -> None:
    steps = int(os.environ.get("PS_STEPS", "12"))
    every = int(os.environ.get("PS_CKPT_EVERY", "3"))
    kill_at = int(os.environ.get("PS_KILL_AT", "-1"))
    # torchrun's TORCHELASTIC_RESTART_COUNT is per node (a node whose workers did not fail
    # restarts without counting): rank 0 counts its own starts in PS_DIR instead.
    attempt = len(list(out.glob("start-*")))
    (out / f"start-{attempt}").write_text(str(os.getpid()))
    start, saved = _load(out / "ckpt.pt")
    print(f"PS attempt {attempt} resumes at step {start}", flush=True)
    shards = [
        asyncrpc.remote(f"trainer{r}", Shard, args=(r, None if saved is None else saved[r - 1]))
        for r in range(1, world)
    ]
    for step in range(start, steps):
        trainer = f"trainer{1 + step % (world - 1)}"
        if step == kill_at and attempt == 0:
            asyncrpc.rpc_async(trainer, die)
            time.sleep(60)  # torchrun stops this attempt once it sees the dead worker
        loss = asyncrpc.rpc_sync(trainer, train_step, args=(shards, step))
        print(f"PS step {step} on {trainer} loss {loss:.5f}", flush=True)
        if (step + 1) % every == 0:
            _save(out / "ckpt.pt", step + 1, shards)
    final = [asyncrpc.rpc_sync(s.owner_name(), weights, args=(s,)) for s in shards]
    torch.save(final, out / "final.pt")
    for r in range(1, world):
        asyncrpc.rpc_sync(f"trainer{r}", release_optimizer)
    print(f"PS done {steps} steps on {world} workers, attempt {attempt}", flush=True)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(os.environ.get("PS_DIR", "."))
    options = asyncrpc.RpcBackendOptions(
        listen_host="0.0.0.0", advertise_host=os.environ.get("RPC_ADVERTISE_HOST"),
        rpc_timeout=60.0, shutdown_timeout=60.0,
    )  # fmt: skip
    asyncrpc.init_rpc(f"trainer{rank}", rpc_backend_options=options)
    if rank == 0:
        drive(world, out)
    asyncrpc.shutdown()


if __name__ == "__main__":
    main()
