"""A parameter server that drops a lost trainer and goes on.

Rank 0 ("ps") applies one averaged SGD step each time every live trainer has pushed its
gradients. Each trainer registers first; ``ps_join`` calls ``asyncrpc.on_caller_lost`` for
it, so when a trainer dies the server forgets it: its gradients for the step under way are
discarded, and the step goes ahead with the trainers that are left, instead of waiting
for one that will never push. One trainer kills itself (SIGKILL) after ``--die-after``
steps; the others finish every step and the loss still falls.

    python -m examples.failures.drop_trainer --trainers 3 --steps 20 --die-after 5
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import async_execution
from asyncrpc.testing import free_port
from examples._launch import DEADLINE_S, workers, write_json
from examples.parameter_server.ps import make_data, make_model


class Server:
    """The model, and the step under way: who is alive, who has pushed."""

    def __init__(self, trainers: int, lr: float) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.expected = trainers
        self.lock = threading.Lock()  # served calls and loss callbacks run on many threads
        self.live: set[str] = set()
        self.pushed: dict[str, tuple[list[torch.Tensor], float]] = {}
        self.step_done: asyncrpc.Future[list[torch.Tensor]] = asyncrpc.Future()
        self.all_joined: asyncrpc.Future[None] = asyncrpc.Future()
        self.losses: list[float] = []
        self.trainers_per_step: list[int] = []
        self.dropped: list[list[str]] = []

    def join(self, trainer: str) -> asyncrpc.Future[None]:
        with self.lock:
            self.live.add(trainer)
            if len(self.live) == self.expected:
                self.all_joined.set_result(None)
        # The caller is `trainer`: when it is gone, forget it and go on without it.
        asyncrpc.on_caller_lost(lambda error: self.drop(trainer, error))
        return self.all_joined

    def drop(self, trainer: str, error: asyncrpc.PeerLostError) -> None:
        with self.lock:
            if trainer not in self.live:
                return
            self.live.discard(trainer)
            self.pushed.pop(trainer, None)
            if error.evidence == "goodbye":
                return  # it finished and shut down: nothing to go on without
            self.dropped.append([trainer, error.evidence])
            print(f"ps: dropped {trainer} ({error.evidence}), going on without it", flush=True)
            self._step_if_complete()

    def push(self, trainer: str, grads: list[torch.Tensor], loss: float) -> asyncrpc.Future[Any]:
        with self.lock:
            self.pushed[trainer] = (grads, loss)
            done = self.step_done
            self._step_if_complete()
        return done

    def _step_if_complete(self) -> None:
        # Under the lock: every live trainer has pushed (a dropped one is not waited for).
        if not self.pushed or not self.live <= set(self.pushed):
            return
        count = len(self.pushed)
        for i, param in enumerate(self.model.parameters()):
            param.grad = sum(grads[i] for grads, _ in self.pushed.values()) / count
        self.optimizer.step()
        self.losses.append(sum(loss for _, loss in self.pushed.values()) / count)
        self.trainers_per_step.append(count)
        self.pushed = {}
        done, self.step_done = self.step_done, asyncrpc.Future()
        done.set_result([p.detach().clone() for p in self.model.parameters()])


_SERVER: Server | None = None
MODULE = "examples.failures.drop_trainer"  # its workers run it, and its functions pickle by it


@async_execution
def ps_join(trainer: str) -> asyncrpc.Future[None]:
    """Register ``trainer``; returns once every trainer has joined."""
    assert _SERVER is not None
    return _SERVER.join(trainer)


@async_execution
def ps_push(trainer: str, grads: list[torch.Tensor], loss: float) -> asyncrpc.Future[Any]:
    """One trainer's gradients; the reply is the weights after the step they join."""
    assert _SERVER is not None
    return _SERVER.push(trainer, grads, loss)


def train(args: argparse.Namespace) -> None:
    """A trainer's loop (ranks 1..N); the last one dies after ``--die-after`` steps."""
    name = f"trainer{args.rank}"
    asyncrpc.init_rpc(name, rank=args.rank, world_size=args.world_size,
                      rpc_backend_options=_options(args))  # fmt: skip
    model = make_model()
    x, y = make_data(args.rank, args.batch)
    asyncrpc.rpc_sync("ps", ps_join, args=(name,))
    for step in range(args.steps):
        if args.rank == args.world_size - 1 and step == args.die_after:
            print(f"{name}: dies now (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # this very process, as a crash would
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        weights = asyncrpc.rpc_sync("ps", ps_push, args=(name, grads, loss.item()))
        with torch.no_grad():
            for param, value in zip(model.parameters(), weights, strict=True):
                param.copy_(value)
    asyncrpc.shutdown()


def _options(args: argparse.Namespace) -> asyncrpc.RpcBackendOptions:
    # The dead trainer is left out of the shutdown barrier with a warning (the default).
    return asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=args.timeout)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.failures.drop_trainer")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--die-after", type=int, default=5, help="steps the last one makes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=DEADLINE_S)
    parser.add_argument("--json", help="write the outcome here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=0)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the example; exit 0 when every step was applied and the loss fell."""
    global _SERVER
    args = parse(argv)
    if args.role == "worker":
        train(args)
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    args.world_size = args.trainers + 1
    started = time.monotonic()
    print(f"ps + {args.trainers} trainers, {args.steps} steps; the last trainer dies after "
          f"{args.die_after}", flush=True)  # fmt: skip
    extra = ["--steps", str(args.steps), "--die-after", str(args.die_after), "--batch",
             str(args.batch), "--timeout", str(args.timeout)]  # fmt: skip
    ranks = range(1, args.world_size)
    _SERVER = server = Server(args.trainers, args.lr)
    with workers(MODULE, ranks, args.world_size, args.init_method, extra, args.deadline,
                 may_fail=[args.world_size - 1]):  # fmt: skip
        asyncrpc.init_rpc("ps", rank=0, world_size=args.world_size,
                          rpc_backend_options=_options(args))  # fmt: skip
        asyncrpc.shutdown()  # serves until the live trainers are done
    losses = server.losses
    fell = len(losses) == args.steps and losses[-1] < losses[0]
    print(f"{len(losses)} steps applied, trainers per step {server.trainers_per_step}; "
          f"dropped {server.dropped}; loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"in {time.monotonic() - started:.1f}s", flush=True)  # fmt: skip
    write_json(args.json, {"losses": losses, "trainers_per_step": server.trainers_per_step,
                           "dropped": server.dropped})  # fmt: skip
    return 0 if fell and server.dropped else 1


if __name__ == "__main__":
    # Run as the module proper, not as __main__: the functions called remotely are
    # pickled by their module's name, which every worker imports.
    sys.exit(importlib.import_module(MODULE).main())
