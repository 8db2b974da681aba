"""Model parallelism over RRefs: two ``nn.Module`` shards live on two workers.

The driver (rank 0) creates each shard on its worker with ``asyncrpc.remote`` and drives
forward and backward through the RRef proxies. asyncrpc has no distributed autograd, so the
backward pass is explicit: each shard keeps its last input and output, ``backward(grad)``
runs autograd locally and returns the gradient of its input. The result is checked against
the same two shards trained in one process with plain autograd.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import asyncrpc
from asyncrpc.testing import free_port
from examples._launch import workers, write_json


class Shard(nn.Module):
    """One half of the model; remembers its last input/output for an explicit backward."""

    def __init__(self, dims: tuple[int, int], seed: int, relu: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(*dims)
        self.relu = relu
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the shard; keep the graph for ``backward``; return the output detached."""
        self._input = x.detach().requires_grad_()
        out = self.linear(self._input)
        self._output = torch.relu(out) if self.relu else out
        return self._output.detach()

    def backward(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Backpropagate ``grad_output`` through the last forward; return d(loss)/d(input)."""
        assert self._input is not None
        assert self._output is not None
        self._output.backward(grad_output)
        grad = self._input.grad
        assert grad is not None
        return grad

    def step(self, lr: float) -> None:
        """Plain SGD on this shard's parameters, then clear the gradients."""
        with torch.no_grad():
            for p in self.parameters():
                assert p.grad is not None
                p.sub_(lr * p.grad)
                p.grad = None

    def state(self) -> list[torch.Tensor]:
        """A copy of the parameters."""
        return [p.detach().clone() for p in self.parameters()]


SHARDS = (((8, 16), 1, True), ((16, 1), 2, False))


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_local(steps: int, batch: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The reference: the same shards in one process, one autograd graph, same SGD."""
    model = nn.Sequential(*(Shard(*spec) for spec in SHARDS))
    x, y = make_data(steps * batch)
    losses = []
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        out = model[1].linear(torch.relu(model[0].linear(xb)))
        loss = nn.functional.mse_loss(out, yb)
        loss.backward()
        for shard in model:
            shard.step(lr)
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def train_remote(steps: int, batch: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The same training with shard i on worker ``shard{i}``, driven through RRefs."""
    shards = [asyncrpc.remote(f"shard{i + 1}", Shard, args=spec) for i, spec in enumerate(SHARDS)]
    x, y = make_data(steps * batch)
    losses = []
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        h = xb
        for shard in shards:
            h = shard.rpc_sync().forward(h)
        out = h.requires_grad_()
        loss = nn.functional.mse_loss(out, yb)
        loss.backward()
        grad = out.grad
        for shard in reversed(shards):
            grad = shard.rpc_sync().backward(grad)
        # The two shards step in parallel: rpc_async proxies return futures.
        asyncrpc.wait_all([shard.rpc_async().step(lr) for shard in shards])
        losses.append(loss.item())
    params = [t for shard in shards for t in shard.rpc_sync().state()]
    return losses, params


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.model_parallel")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
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
    """Train both ways; exit 0 when the distributed run matches the reference."""
    args = parse(argv)
    if args.role == "worker":
        _join(f"shard{args.rank}", args)
        asyncrpc.shutdown()
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    with workers(__name__, [1, 2], 3, args.init_method):
        _join("driver", args)
        try:
            losses, params = train_remote(args.steps, args.batch, args.lr)
        finally:
            asyncrpc.shutdown()
    ref_losses, ref_params = train_local(args.steps, args.batch, args.lr)
    for s in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {s + 1:3d}  loss {losses[s]:.5f}  (single process {ref_losses[s]:.5f})")
    same = torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6) and all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(params, ref_params, strict=True)
    )
    print(f"losses and parameters match the single-process model: {same}", flush=True)
    write_json(args.json, {"losses": losses, "reference": ref_losses, "match": same})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
