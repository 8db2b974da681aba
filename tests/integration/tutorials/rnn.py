"""The RNN model-parallel half of "Getting Started with Distributed RPC Framework".

The embedding table and the decoder live on ``ps`` behind RRefs; the LSTM is local to the
trainer. ``DistributedOptimizer`` takes the remote parameters' RRefs and the trainer's own
``RRef(p)`` for the LSTM's, side by side. Sizes are tiny and the batches are seeded
(the tutorial draws them from uninitialized memory). With ``--full``, the sizes and
lengths of pytorch/examples ``distributed/rpc/rnn``: 10 epochs of 5 batches.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
    from torch.distributed.optim import DistributedOptimizer
else:
    import asyncrpc as rpc
    from asyncrpc import autograd as dist_autograd
    from asyncrpc.optim import DistributedOptimizer

if full():
    NTOKEN, NINP, NHID, NLAYERS, NBATCH, NINDICES = 7, 2, 3, 4, 5, 6
    EPOCHS, BATCHES = 10, 5
else:
    NTOKEN, NINP, NHID, NLAYERS, NBATCH, NINDICES = 10, 2, 3, 2, 5, 10
    EPOCHS, BATCHES = 2, 3


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    """On the owner of ``rref``: call ``method`` on its value."""
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``method`` on the value behind ``rref``, on its owner, and wait for the result."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


def _parameter_rrefs(module: nn.Module) -> list[Any]:
    """An RRef to each of ``module``'s parameters (made where the module lives)."""
    return [rpc.RRef(p) for p in module.parameters()]


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        with seeded(1):
            self.drop = nn.Dropout(dropout)
            self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(tokens))


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        with seeded(2):
            self.drop = nn.Dropout(dropout)
            self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    """Embedding and decoder on ``ps`` (RRefs), the LSTM here."""

    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int) -> None:
        super().__init__()
        # Dropout 0: random masks drawn on the owner's pool threads are not reproducible.
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, 0.0))
        with seeded(3):
            self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, 0.0))

    def forward(
        self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, tokens)
        output, hidden = self.rnn(emb, hidden)
        return _remote_method(Decoder.forward, self.decoder_rref, output), hidden

    def parameter_rrefs(self) -> list[Any]:
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))  # the caller's own RRef(p)s
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params

    def weights(self) -> list[torch.Tensor]:
        return [
            *_remote_method(_weights, self.emb_table_rref),
            *_weights(self.rnn),
            *_remote_method(_weights, self.decoder_rref),
        ]


def get_next_batch(gen: torch.Generator) -> Any:
    for _ in range(BATCHES):
        data = torch.randint(0, NTOKEN, (NBATCH, NINDICES), generator=gen)
        target = torch.randint(0, NTOKEN, (NBATCH * NINDICES,), generator=gen)
        yield data, target


def run_trainer() -> dict[str, Any]:
    model = RNNModel("ps", NTOKEN, NINP, NHID, NLAYERS)
    initial = model.weights()
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    hidden = (torch.zeros(NLAYERS, NINDICES, NHID), torch.zeros(NLAYERS, NINDICES, NHID))
    gen, losses = torch.Generator().manual_seed(0), []
    for _epoch in range(EPOCHS):
        for data, target in get_next_batch(gen):
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, NTOKEN), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.detach())
    return {"losses": torch.stack(losses), "initial": initial, "final": model.weights()}


def run_worker(args: argparse.Namespace) -> None:
    if args.rank == 1:
        rpc.init_rpc("trainer", rank=args.rank, world_size=args.world_size)
        save(args, run_trainer())
    else:
        rpc.init_rpc("ps", rank=args.rank, world_size=args.world_size)
        # the parameter server does nothing but serve the trainer's calls
    rpc.shutdown()


if __name__ == "__main__":
    main(2, run_worker)
