"""Pipeline parallelism with streams and distributed autograd, on asyncrpc.

The model is three parts: an encoder on the trainer (rank 0), stage 1 on worker
``stage1`` and stage 2 on worker ``stage2``. Each step splits the batch into
micro-batches and streams them through the stages: the trainer opens one stream on stage
2, passing its encoded micro-batches as a stream argument; stage 2 passes that argument
on, unread, to a stream it opens on stage 1, and maps stage 1's outputs as they come. So
stage 1 works on micro-batch k+1 while stage 2 works on k, and the trainer gets stage 2's
outputs as a stream. Everything runs inside one distributed autograd context, so the
stream items carry gradients both ways: ``backward`` sends them from the trainer to stage
2, from stage 2 to stage 1 and from stage 1 back into the trainer's encoder, and a
``DistributedOptimizer`` steps SGD on every part. The same model trained in one process
must give the same losses and final weights.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.optim import DistributedOptimizer
from asyncrpc.testing import free_port
from examples._launch import workers, write_json

D_IN, D_ENC, D_HID, D_OUT = 6, 8, 16, 4
BATCH = 16
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32 sums taken in another order


def _seeded(seed: int, module: type[nn.Module], *args: Any) -> nn.Module:
    torch.manual_seed(seed)
    return module(*args)


class Stage(nn.Module):
    """One stage: a linear layer and a tanh."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


async def run_stage(
    stage: asyncrpc.RRef[Stage], inputs: Any, upstream: list[asyncrpc.RRef[Stage]]
) -> AsyncIterator[torch.Tensor]:
    """Runs on a stage's worker, as a stream: maps this stage over its input stream as the
    items come. With stages ``upstream``, its input is the last of them run over
    ``inputs`` (passed on unread: that stage reads the trainer's items itself)."""
    module = stage.local_value()
    if upstream:
        previous = upstream[-1]
        inputs = asyncrpc.stream(previous.owner(), run_stage, previous, inputs, upstream[:-1])
    async for x in inputs:
        yield module(x)


def _parameter_rrefs(stage: asyncrpc.RRef[Stage]) -> list[asyncrpc.RRef[Any]]:
    """Runs on the stage's owner: an RRef to each of its parameters."""
    return [asyncrpc.RRef(p) for p in stage.local_value().parameters()]


def _weights(stage: asyncrpc.RRef[Stage]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.local_value().parameters()]


def make_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of a fixed smooth function the model can learn: the loss falls."""
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(D_IN, D_OUT, generator=gen) / D_IN**0.5
    data = []
    for _ in range(steps):
        x = torch.randn(BATCH, D_IN, generator=gen)
        data.append((x, torch.tanh(x @ truth)))
    return data


def _loss(outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    # The mean of the micro-batches' losses: the batch's mean squared error.
    losses = [
        nn.functional.mse_loss(o, t, reduction="sum") for o, t in zip(outputs, targets, strict=True)
    ]
    return torch.stack(losses).sum() / (BATCH * D_OUT)


def train_pipeline(steps: int, micro: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """Each step: micro-batches through encoder -> stage1 -> stage2 as streams, one
    distributed backward, one distributed SGD step."""
    encoder = _seeded(1, nn.Linear, D_IN, D_ENC)
    stages = [
        asyncrpc.remote("stage1", Stage, args=(D_ENC, D_HID, 2)),
        asyncrpc.remote("stage2", Stage, args=(D_HID, D_OUT, 3)),
    ]
    params = [asyncrpc.RRef(p) for p in encoder.parameters()]
    for stage in stages:
        params += asyncrpc.rpc_sync(stage.owner(), _parameter_rrefs, args=(stage,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=lr)
    losses = []
    for x, y in make_data(steps):
        with dist_autograd.context() as context_id:
            encoded = (encoder(part) for part in x.chunk(micro))  # made as stage 1 reads
            last = stages[-1]
            outputs = list(asyncrpc.stream(
                last.owner(), run_stage, last, asyncrpc.stream_arg(encoded), stages[:-1]
            ))  # fmt: skip
            loss = _loss(outputs, list(y.chunk(micro)))
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.item())
    weights = [p.detach().clone() for p in encoder.parameters()]
    for stage in stages:
        weights += asyncrpc.rpc_sync(stage.owner(), _weights, args=(stage,))
    return losses, weights


def train_local(steps: int, micro: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The reference: the same parts and micro-batches in one process, plain autograd."""
    parts = [_seeded(1, nn.Linear, D_IN, D_ENC), Stage(D_ENC, D_HID, 2), Stage(D_HID, D_OUT, 3)]
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=lr)
    losses = []
    for x, y in make_data(steps):
        optimizer.zero_grad()
        outputs = [parts[2](parts[1](parts[0](part))) for part in x.chunk(micro)]
        loss = _loss(outputs, list(y.chunk(micro)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for part in parts for p in part.parameters()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.pipeline_parallel")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def _join(name: str, args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=60.0)
    asyncrpc.init_rpc(name, rank=args.rank, world_size=3, rpc_backend_options=options)


def main(argv: list[str] | None = None) -> int:
    """Train with the pipeline and in one process; exit 0 when they match."""
    args = parse(argv)
    if args.role == "worker":
        _join(("stage1", "stage2")[args.rank - 1], args)
        asyncrpc.shutdown()
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    with workers(__name__, [1, 2], 3, args.init_method):
        _join("trainer", args)
        try:
            losses, weights = train_pipeline(args.steps, args.micro_batches, args.lr)
        finally:
            asyncrpc.shutdown()
    ref_losses, ref_weights = train_local(args.steps, args.micro_batches, args.lr)
    # Every part was trained (gradients reached the encoder through both streams too).
    initial = train_local(0, args.micro_batches, args.lr)[1]
    moved = all(not torch.equal(a, b) for a, b in zip(weights, initial, strict=True))
    for s in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {s + 1:3d}  loss {losses[s]:.6f}  (single process {ref_losses[s]:.6f})")
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    weight_diff = max((a - b).abs().max().item() for a, b in zip(weights, ref_weights, strict=True))
    same = torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCE) and all(
        torch.allclose(a, b, **TOLERANCE) for a, b in zip(weights, ref_weights, strict=True)
    )
    print(f"largest difference: loss {loss_diff:.2e}, weight {weight_diff:.2e}")
    print(f"every part trained: {moved}; losses and weights match the single-process "
          f"model: {same}", flush=True)  # fmt: skip
    write_json(args.json, {
        "losses": losses, "reference": ref_losses, "loss_diff": loss_diff,
        "weight_diff": weight_diff, "match": same, "moved": moved,
    })  # fmt: skip
    return 0 if same and moved else 1


if __name__ == "__main__":
    sys.exit(main())
