"""Two processes train a layer that lives on worker1 with distributed autograd and
DistributedOptimizer (the shape of torch's distributed training tutorials).

``torch_autograd.py`` imports torch's modules; ``asyncrpc_autograd.py`` is the same file
with asyncrpc's imports instead.
"""

# The two files differ by their imports only, so those lines stay as torch users write them.
# ruff: noqa: I001, PLR0402, RUF100
import multiprocessing
import os
import socket

import torch
from torch import nn
import asyncrpc as rpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.optim import DistributedOptimizer


def make_layer():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def forward(layer_rref, x):
    return layer_rref.local_value()(x)


def parameter_rrefs(layer_rref):
    return [rpc.RRef(p) for p in layer_rref.local_value().parameters()]


def weights(layer_rref):
    return [p.detach().clone() for p in layer_rref.local_value().parameters()]


def train(steps):
    layer = rpc.remote("worker1", make_layer)
    params = rpc.rpc_sync("worker1", parameter_rrefs, args=(layer,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        target = x.sum(dim=1, keepdim=True)
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", forward, args=(layer, x))
            loss = (y - target).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(round(loss.item(), 5))
    final = [round(t.sum().item(), 5) for t in rpc.rpc_sync("worker1", weights, args=(layer,))]
    return losses, final


def run(rank, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        losses, final = train(5)
        print("result:", losses, final, flush=True)
    rpc.shutdown()


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run, args=(rank, port)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    return max(p.exitcode for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())
