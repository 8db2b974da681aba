"""The "Implementing a Parameter Server Using Distributed RPC Framework" tutorial.

Rank 0 is ``parameter_server``: it holds one ``ParameterServer`` (the model), made on the
first trainer's ``rpc.remote``. Each trainer holds an RRef to it, runs the forward pass
there, and trains with distributed autograd and a ``DistributedOptimizer`` over the
server's parameter RRefs. Changes from the tutorial: a tiny conv net on seeded synthetic
images instead of MNIST, no dropout, and a turn gate on the server so the two trainers'
steps interleave in one fixed order (T1, T2, T1, ...) and the result is reproducible
(each trainer then tests the model once all have finished).
With ``--full``, the lengths of pytorch/examples ``distributed/rpc/parameter_server``:
three trainers, each one pass in batches of 32 over a training set of MNIST's size and
shape (60,000 images of 28x28 in 10 classes, synthetic), then its accuracy over a test
set of 10,000.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
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
    TRAINERS, BATCH, CLASSES, SIDE, TRAIN_SET, TEST_SET = 3, 32, 10, 28, 60_000, 10_000
else:
    TRAINERS, BATCH, CLASSES, SIDE, TRAIN_SET, TEST_SET = 2, 8, 4, 10, 32, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * ((SIDE - 2) // 2) ** 2, 16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return rpc.rpc_sync(rref.owner(), call_method, args=(method, rref, *args), kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with seeded(0):
            self.model = Net()
        self.initial = [p.detach().clone() for p in self.model.parameters()]

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.model(inp)

    def get_dist_gradients(self, cid: int) -> dict[torch.Tensor, torch.Tensor]:
        return dict(dist_autograd.get_gradients(cid))

    def get_param_rrefs(self) -> list[Any]:
        return [rpc.RRef(param) for param in self.model.parameters()]


param_server: ParameterServer | None = None
global_lock = threading.Lock()


def get_parameter_server() -> ParameterServer:
    """The server's one ``ParameterServer``, made by whichever trainer asks first."""
    global param_server
    with global_lock:
        if param_server is None:
            param_server = ParameterServer()
        return param_server


# Not in the tutorial: trainer k (0-based) may step only on turn step*TRAINERS + k.
_turn = 0
_turn_changed = threading.Condition()


def wait_turn(turn: int) -> None:
    with _turn_changed:
        if not _turn_changed.wait_for(lambda: _turn == turn, timeout=30.0):
            raise TimeoutError(f"turn {turn} never came (at {_turn})")


def end_turn() -> None:
    global _turn
    with _turn_changed:
        _turn += 1
        _turn_changed.notify_all()


class TrainerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self) -> list[Any]:
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def make_data(seed: int, images: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of ``images`` in all (the last one short, as a DataLoader's), each image
    labelled by its brightest of ``CLASSES`` strips of its pixels in order, so there is
    something to learn."""
    gen = torch.Generator().manual_seed(seed)
    strip = SIDE * SIDE // CLASSES
    for start in range(0, images, BATCH):
        batch = torch.rand(min(BATCH, images - start), 1, SIDE, SIDE, generator=gen)
        strips = batch.flatten(1)[:, : strip * CLASSES].unflatten(1, (CLASSES, strip))
        yield batch, strips.sum(-1).argmax(1)


def run_training_loop(trainer: int) -> dict[str, Any]:
    net = TrainerNet()
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.03)
    losses, grad_norms = [], []
    for i, (data, target) in enumerate(make_data(trainer, TRAIN_SET)):
        rpc.rpc_sync("parameter_server", wait_turn, args=(i * TRAINERS + trainer,))
        with dist_autograd.context() as cid:
            model_output = net(data)
            loss = F.nll_loss(model_output, target)
            dist_autograd.backward(cid, [loss])
            grads = remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid)
            assert grads != {}
            opt.step(cid)
        rpc.rpc_sync("parameter_server", end_turn)
        losses.append(loss.detach())
        # Sorted: the dict's order is the owner's, and float sums depend on the order.
        grad_norms.append(torch.stack(sorted(g.pow(2).sum() for g in grads.values())).sum())
    # Not in the tutorial: measure the model every trainer has finished with (a trainer
    # done first would otherwise test a model the others are still stepping).
    rpc.rpc_sync("parameter_server", wait_turn, args=(len(losses) * TRAINERS,))
    return {"losses": torch.stack(losses), "grad_norms": torch.stack(grad_norms),
            "accuracy": get_accuracy(net)}  # fmt: skip


def get_accuracy(net: TrainerNet) -> float:
    correct = 0
    with torch.no_grad():
        for data, target in make_data(100, TEST_SET):
            correct += int((net(data).argmax(dim=1) == target).sum())
    return correct / TEST_SET


def run_worker(args: argparse.Namespace) -> None:
    if args.rank == 0:
        rpc.init_rpc("parameter_server", rank=args.rank, world_size=args.world_size)
        rpc.shutdown()  # serves the trainers until every worker is done
        assert param_server is not None
        final = [p.detach().clone() for p in param_server.model.parameters()]
        save(args, {"initial": param_server.initial, "final": final})
    else:
        rpc.init_rpc(f"trainer_{args.rank}", rank=args.rank, world_size=args.world_size)
        results = run_training_loop(args.rank - 1)
        rpc.shutdown()
        save(args, results)


if __name__ == "__main__":
    main(1 + TRAINERS, run_worker)
