"""Model parallelism with distributed autograd: torch's RNN model-parallel tutorial, on
asyncrpc.

Worker ``ps_emb`` holds the embedding table; worker ``ps_rnn`` holds the LSTM and the
decoder; the trainer (rank 0) holds only RRefs to them. Each step runs the forward pass as
RPCs inside a distributed autograd context, ``backward`` sends the gradients back to the
workers that own the parameters, and a ``DistributedOptimizer`` steps the SGD optimizer on
each of them. Trained twice, synchronously (``rpc_sync``, ``backward``, ``step``) and with
asyncio (``await call``, ``backward_async``, awaited step futures), and checked against the
same model trained in one process with plain autograd.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.optim import DistributedOptimizer
from asyncrpc.testing import free_port
from examples._launch import workers, write_json

NTOKEN, NINP, NHID, NLAYERS = 12, 6, 8, 1
BATCH, SEQ = 4, 5
Hidden = tuple[torch.Tensor, torch.Tensor]
# A worker builds its parts on pool threads, concurrently: seeding torch's one global
# generator and drawing the initial weights must happen as one step.
_SEEDED = threading.Lock()


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken: int, ninp: int, seed: int) -> None:
        super().__init__()
        with _SEEDED:
            torch.manual_seed(seed)
            self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)


class RNN(nn.Module):
    def __init__(self, ninp: int, nhid: int, nlayers: int, seed: int) -> None:
        super().__init__()
        with _SEEDED:
            torch.manual_seed(seed)
            self.lstm = nn.LSTM(ninp, nhid, nlayers)

    def forward(self, emb: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        output, state = self.lstm(emb, hidden)
        return output, (state[0], state[1])


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int, seed: int) -> None:
        super().__init__()
        with _SEEDED:
            torch.manual_seed(seed)
            self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)


def _call_method(method: Any, rref: asyncrpc.RRef[Any], *args: Any) -> Any:
    """Runs on the owner: ``method(the module, *args)`` (the tutorial's helper)."""
    return method(rref.local_value(), *args)


def _parameter_rrefs(module: nn.Module) -> list[asyncrpc.RRef[Any]]:
    """Runs on the owner (through ``_call_method``): an RRef to each parameter."""
    return [asyncrpc.RRef(p) for p in module.parameters()]


def _state(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class RNNModel:
    """The trainer's view of the model: RRefs to the three parts on their workers."""

    def __init__(self, ps_emb: str, ps_rnn: str) -> None:
        self.parts = [
            asyncrpc.remote(ps_emb, EmbeddingTable, args=(NTOKEN, NINP, 1)),
            asyncrpc.remote(ps_rnn, RNN, args=(NINP, NHID, NLAYERS, 2)),
            asyncrpc.remote(ps_rnn, Decoder, args=(NTOKEN, NHID, 3)),
        ]

    def forward(self, tokens: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        emb_rref, rnn_rref, decoder_rref = self.parts
        emb = _remote_method(EmbeddingTable.forward, emb_rref, tokens)
        output, hidden = _remote_method(RNN.forward, rnn_rref, emb, hidden)
        return _remote_method(Decoder.forward, decoder_rref, output), hidden

    async def forward_async(
        self, tokens: torch.Tensor, hidden: Hidden
    ) -> tuple[torch.Tensor, Hidden]:
        emb_rref, rnn_rref, decoder_rref = self.parts
        emb = await asyncrpc.call(emb_rref.owner(), _call_method, EmbeddingTable.forward,
                                  emb_rref, tokens)  # fmt: skip
        output, hidden = await asyncrpc.call(rnn_rref.owner(), _call_method, RNN.forward,
                                             rnn_rref, emb, hidden)  # fmt: skip
        decoded = await asyncrpc.call(decoder_rref.owner(), _call_method, Decoder.forward,
                                      decoder_rref, output)  # fmt: skip
        return decoded, hidden

    def parameter_rrefs(self) -> list[asyncrpc.RRef[Any]]:
        return [p for part in self.parts for p in _remote_method(_parameter_rrefs, part)]

    def state(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in _remote_method(_state, part)]


def _remote_method(method: Any, rref: asyncrpc.RRef[Any], *args: Any) -> Any:
    return asyncrpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


def make_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token sequences and their next tokens, one batch per step."""
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(steps):
        seq = torch.randint(0, NTOKEN, (SEQ + 1, BATCH), generator=gen)
        data.append((seq[:-1], seq[1:]))
    return data


def _loss(decoded: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(decoded.view(-1, NTOKEN), target.reshape(-1))


def _zero_hidden() -> Hidden:
    return torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID)


def train_remote(steps: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The tutorial's loop: forward as RPCs, distributed backward, distributed SGD step."""
    model = RNNModel("ps_emb", "ps_rnn")
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=lr)
    hidden, losses = _zero_hidden(), []
    for tokens, target in make_data(steps):
        with dist_autograd.context() as context_id:
            decoded, hidden = model.forward(tokens, hidden)
            loss = _loss(decoded, target)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        hidden = (hidden[0].detach(), hidden[1].detach())
        losses.append(loss.item())
    return losses, model.state()


async def train_remote_async(steps: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The same loop in async code: nothing blocks the caller's event loop."""
    model = RNNModel("ps_emb", "ps_rnn")
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=lr)
    hidden, losses = _zero_hidden(), []
    for tokens, target in make_data(steps):
        async with dist_autograd.context() as context_id:
            decoded, hidden = await model.forward_async(tokens, hidden)
            loss = _loss(decoded, target)
            await dist_autograd.backward_async(context_id, [loss])
            for done in optimizer.step_future(context_id):
                await done
        hidden = (hidden[0].detach(), hidden[1].detach())
        losses.append(loss.item())
    return losses, model.state()


def train_local(steps: int, lr: float) -> tuple[list[float], list[torch.Tensor]]:
    """The reference: the same three parts in one process, plain autograd and SGD."""
    parts = [EmbeddingTable(NTOKEN, NINP, 1), RNN(NINP, NHID, NLAYERS, 2), Decoder(NTOKEN, NHID, 3)]
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=lr)
    hidden, losses = _zero_hidden(), []
    for tokens, target in make_data(steps):
        optimizer.zero_grad()
        output, hidden = parts[1](parts[0](tokens), hidden)
        loss = _loss(parts[2](output), target)
        loss.backward()
        optimizer.step()
        hidden = (hidden[0].detach(), hidden[1].detach())
        losses.append(loss.item())
    return losses, [p.detach() for part in parts for p in part.parameters()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.model_parallel")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def _join(name: str, args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=60.0)
    asyncrpc.init_rpc(name, rank=args.rank, world_size=3, rpc_backend_options=options)


def _same(
    a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]
) -> bool:
    losses = torch.allclose(torch.tensor(a[0]), torch.tensor(b[0]), atol=1e-5)
    return losses and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a[1], b[1], strict=True))


def main(argv: list[str] | None = None) -> int:
    """Train three ways; exit 0 when both distributed runs match the reference."""
    args = parse(argv)
    if args.role == "worker":
        _join(("ps_emb", "ps_rnn")[args.rank - 1], args)
        asyncrpc.shutdown()
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    with workers(__name__, [1, 2], 3, args.init_method):
        _join("trainer", args)
        try:
            sync_run = train_remote(args.steps, args.lr)
            async_run = asyncio.run(train_remote_async(args.steps, args.lr))
        finally:
            asyncrpc.shutdown()
    reference = train_local(args.steps, args.lr)
    for s in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {s + 1:3d}  loss {sync_run[0][s]:.5f}  async {async_run[0][s]:.5f}  "
              f"(single process {reference[0][s]:.5f})")  # fmt: skip
    same = _same(sync_run, reference) and _same(async_run, reference)
    print(f"losses and parameters match the single-process model: {same}", flush=True)
    write_json(args.json, {
        "losses": sync_run[0], "async_losses": async_run[0], "reference": reference[0],
        "match": same,
    })  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
