"""The "Combining Distributed DataParallel with Distributed RPC Framework" tutorial.

Ranks 0 and 1 are trainers, rank 2 the master, rank 3 ``ps``. The master makes a
``RemoteModule`` (an ``EmbeddingBag``) on ``ps`` and starts ``_run_trainer`` on both
trainers with ``rpc_async``. Each trainer wraps a local ``Linear`` in
``DistributedDataParallel`` over a gloo group of the two trainers, and trains with
distributed autograd and a ``DistributedOptimizer`` over the remote module's
``remote_parameters()`` and the trainer's own ``RRef(param)``s. Changes from the tutorial:
CPU, fewer and smaller batches, seeds, and the trainers' optimizer steps taken in turn,
trainer 0's then trainer 1's, between barriers: each forward sees both trainers' updates
of the shared table, and the two updates of a row round in one order, whatever the timing
(in either order, one rounding apart grew to 7e-4 in the table over the full length).
With ``--full``, the sizes and lengths of pytorch/examples ``distributed/rpc/ddp_rpc``:
100 epochs of 10 batches of 20 to 50 indices into a table of 100.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
else:
    import asyncrpc as rpc
    from asyncrpc import RRef
    from asyncrpc import autograd as dist_autograd
    from asyncrpc.nn import RemoteModule
    from asyncrpc.optim import DistributedOptimizer

EMBEDDING_DIM = 16
if full():
    NUM_EMBEDDINGS, EPOCHS, BATCHES, INDICES, MAX_BAG = 100, 100, 10, (20, 50), 10
else:
    NUM_EMBEDDINGS, EPOCHS, BATCHES, INDICES, MAX_BAG = 20, 2, 3, (6, 12), 4


class HybridModel(torch.nn.Module):
    """The remote embedding table, then a local Linear under DDP."""

    def __init__(self, remote_emb_module: Any) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        with seeded(0):
            self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, 8))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def get_next_batch() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    for _ in range(BATCHES):
        num_indices = random.randint(*INDICES)
        indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,))
        offsets, start, batch_size = [], 0, 0
        while start < num_indices:
            offsets.append(start)
            start += random.randint(1, MAX_BAG)
            batch_size += 1
        target = torch.randint(0, 8, (batch_size,))
        yield indices, torch.tensor(offsets), target


def _run_trainer(remote_emb_module: Any, rank: int) -> dict[str, Any]:
    random.seed(rank)  # the batches: seeded on this (the trainer's) pool thread
    torch.manual_seed(rank)
    model = HybridModel(remote_emb_module)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(EPOCHS):
        for indices, offsets, target in get_next_batch():
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                step_in_turn(opt, context_id, rank)
            losses.append(loss.detach())
    fc = [p.detach().clone() for p in model.fc.parameters()]
    return {"losses": torch.stack(losses), "fc": fc}


def step_in_turn(opt: Any, context_id: int, rank: int) -> None:
    """Not in the tutorial: trainer 0 steps, then trainer 1 (see the module's docstring)."""
    for turn in (0, 1):
        if rank == turn:
            opt.step(context_id)
        dist.barrier()


def seed(value: int) -> None:
    torch.manual_seed(value)


def run_master() -> dict[str, Any]:
    rpc.rpc_sync("ps", seed, args=(0,))  # the table is drawn on ps from its global generator
    remote_emb_module = RemoteModule(
        "ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
    )
    initial = [p.to_here().detach() for p in remote_emb_module.remote_parameters()]
    futs = [
        rpc.rpc_async(f"trainer{trainer_rank}", _run_trainer,
                      args=(remote_emb_module, trainer_rank))
        for trainer_rank in [0, 1]
    ]  # fmt: skip
    trainers = [fut.wait() for fut in futs]
    final = [p.to_here().detach() for p in remote_emb_module.remote_parameters()]
    return {"trainers": trainers, "initial": initial, "final": final}


def run_worker(args: argparse.Namespace) -> None:
    rpc_backend_options = rpc.TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    if args.rank == 2:
        rpc.init_rpc("master", rank=args.rank, world_size=args.world_size,
                     rpc_backend_options=rpc_backend_options)  # fmt: skip
        save(args, run_master())
    elif args.rank <= 1:
        dist.init_process_group(backend="gloo", rank=args.rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{args.pg_port}")  # fmt: skip
        rpc.init_rpc(f"trainer{args.rank}", rank=args.rank, world_size=args.world_size,
                     rpc_backend_options=rpc_backend_options)  # fmt: skip
    else:
        rpc.init_rpc("ps", rank=args.rank, world_size=args.world_size,
                     rpc_backend_options=rpc_backend_options)  # fmt: skip
    rpc.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(4, run_worker)
