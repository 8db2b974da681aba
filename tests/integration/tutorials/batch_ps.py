"""The batch-updating parameter server of "Implementing Batch RPC Processing Using
Asynchronous Executions".

``update_and_fetch_model`` is an ``@rpc.functions.async_execution`` static method: each
trainer's call adds its gradients and returns the server's current future, without
holding a thread; the last trainer of a round steps the optimizer and completes that
future, which answers every trainer of the round with the new model. Changes from the
tutorial: a tiny conv net instead of torchvision's ResNet-50, and the gradient sum is
taken under the lock (two in-place adds racing on one tensor can lose one). With
``--full``, the lengths of pytorch/examples ``distributed/rpc/batch/parameter_server.py``:
five trainers, six batches each of 20 images of 64x64 in 30 classes.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
else:
    import asyncrpc as rpc

if full():
    TRAINERS, NUM_CLASSES, NUM_BATCHES, BATCH_SIZE, IMAGE_W, IMAGE_H = 5, 30, 6, 20, 64, 64
else:
    TRAINERS, NUM_CLASSES, NUM_BATCHES, BATCH_SIZE, IMAGE_W, IMAGE_H = 2, 6, 3, 8, 8, 8


def make_model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            nn.Linear(16, NUM_CLASSES),
        )  # fmt: skip


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int) -> None:
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model: torch.futures.Future[nn.Module] = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref: Any) -> None:
        self.ps_rref, self.loss_fn = ps_rref, nn.MSELoss()
        # Seeded here (on the trainer's pool thread): the batches are drawn below.
        torch.manual_seed(rpc.get_worker_info().id)
        self.one_hot_indices = torch.randint(0, NUM_CLASSES, (BATCH_SIZE, 1))

    def get_next_batch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(NUM_BATCHES):
            inputs = torch.randn(BATCH_SIZE, 3, IMAGE_W, IMAGE_H)
            labels = torch.zeros(BATCH_SIZE, NUM_CLASSES).scatter_(1, self.one_hot_indices, 1)
            yield inputs, labels

    def train(self) -> torch.Tensor:
        losses = []
        m = self.ps_rref.rpc_sync().get_model()
        for inputs, labels in self.get_next_batch():
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.detach())
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.parameters()]),
            )
        return torch.stack(losses)


def run_trainer(ps_rref: Any) -> torch.Tensor:
    return Trainer(ps_rref).train()


def run_ps(trainers: list[str]) -> dict[str, Any]:
    ps = BatchUpdateParameterServer(len(trainers))
    initial = [p.detach().clone() for p in ps.model.parameters()]
    ps_rref = rpc.RRef(ps)
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref,)) for trainer in trainers]
    losses = torch.futures.wait_all(futs)
    final = [p.detach().clone() for p in ps.model.parameters()]
    return {"losses": dict(zip(trainers, losses, strict=True)), "initial": initial, "final": final}


def run_worker(args: argparse.Namespace) -> None:
    if args.rank != 0:
        rpc.init_rpc(f"trainer{args.rank}", rank=args.rank, world_size=args.world_size)
    else:
        rpc.init_rpc("ps", rank=args.rank, world_size=args.world_size)
        save(args, run_ps([f"trainer{r}" for r in range(1, args.world_size)]))
    rpc.shutdown()


if __name__ == "__main__":
    main(1 + TRAINERS, run_worker)
