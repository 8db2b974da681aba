"""The "Distributed Pipeline Parallelism Using RPC" tutorial.

A ResNet-like model is cut in two shards, one on ``worker1`` and one on ``worker2``,
behind RRefs. The master splits each batch into micro-batches: for each, it wraps the
input in an ``RRef``, asks shard 1 for an RRef to its output (``rref.remote()``) and shard
2 for a future of the final output (``rref.rpc_async()``), so the shards work on
different micro-batches at once; distributed autograd and a ``DistributedOptimizer`` train
both shards. Changes from the tutorial: a tiny residual conv net instead of ResNet-50,
CPU only, one split setting a run (``--split``). With ``--full``, the lengths of
pytorch/examples ``distributed/rpc/pipeline``: three batches of 120 images of 128x128 in
1000 classes; that program runs once for each micro-batch size of 1, 2, 4 and 8.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
from torch import nn

from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
else:
    import asyncrpc as rpc
    from asyncrpc import RRef
    from asyncrpc import autograd as dist_autograd
    from asyncrpc.optim import DistributedOptimizer

if full():
    NUM_CLASSES, NUM_BATCHES, BATCH_SIZE, IMAGE_W, IMAGE_H = 1000, 3, 120, 128, 128
    THREADS, RPC_TIMEOUT = 256, 300  # the upstream's options
else:
    NUM_CLASSES, NUM_BATCHES, BATCH_SIZE, IMAGE_W, IMAGE_H = 5, 3, 8, 12, 12
    THREADS, RPC_TIMEOUT = 16, 60


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + identity)


class ResNetBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def parameter_rrefs(self) -> list[Any]:
        return [RRef(p) for p in self.parameters()]

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters()]


class ResNetShard1(ResNetBase):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        with seeded(1):
            self.seq = nn.Sequential(
                nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(8),
                nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2), BasicBlock(8, 8),
            ).to(self.device)  # fmt: skip
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        with seeded(2):
            self.seq = nn.Sequential(BasicBlock(8, 16, stride=2), nn.AdaptiveAvgPool2d((1, 1)))
            self.fc = nn.Linear(16, NUM_CLASSES)

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


class DistResNet(nn.Module):
    def __init__(self, split_size: int, workers: list[str]) -> None:
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], ResNetShard1, args=("cpu",))
        self.p2_rref = rpc.remote(workers[1], ResNetShard2, args=("cpu",))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self) -> list[Any]:
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params

    def weights(self) -> list[torch.Tensor]:
        return [*self.p1_rref.rpc_sync().weights(), *self.p2_rref.rpc_sync().weights()]


def run_master(split_size: int) -> dict[str, Any]:
    model = DistResNet(split_size, ["worker1", "worker2"])
    initial = model.weights()
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    torch.manual_seed(0)
    one_hot_indices = torch.randint(0, NUM_CLASSES, (BATCH_SIZE, 1))
    losses = []
    for _ in range(NUM_BATCHES):
        inputs = torch.randn(BATCH_SIZE, 3, IMAGE_W, IMAGE_H)
        labels = torch.zeros(BATCH_SIZE, NUM_CLASSES).scatter_(1, one_hot_indices, 1)
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "initial": initial, "final": model.weights()}


def run_worker(args: argparse.Namespace) -> None:
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=THREADS, rpc_timeout=RPC_TIMEOUT)
    if args.rank == 0:
        rpc.init_rpc("master", rank=args.rank, world_size=args.world_size,
                     rpc_backend_options=options)  # fmt: skip
        save(args, run_master(args.split))
    else:
        rpc.init_rpc(f"worker{args.rank}", rank=args.rank, world_size=args.world_size,
                     rpc_backend_options=options)  # fmt: skip
    rpc.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", type=int, default=4, help="images in a micro-batch")


if __name__ == "__main__":
    main(3, run_worker, add_arguments)
