"""A batch-updating parameter server (torch's tutorial pattern) written with asyncio.

Rank 0 ("ps") owns the model behind an RRef. Each of N trainer processes runs an
``async def`` training loop that ``await asyncrpc.call``s the server to push its gradients
and get the new weights back. ``update_and_fetch`` is ``@async_execution``: each reply is a
shared future the server completes once all N trainers of a step have pushed, so a step's
N gradients are applied together, as one averaged update.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc.functions import async_execution
from asyncrpc.testing import free_port
from examples._launch import DEADLINE_S, workers, write_json

IN, HIDDEN, CLASSES = 16, 32, 4


def make_model() -> nn.Module:
    """The small MLP every process builds (same seed: same initial weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_data(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic labelled data: a fixed random "teacher" labels Gaussian inputs."""
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(rank))
    return x, (x @ teacher).argmax(dim=1)


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ParameterServer:
    """Holds the model; applies one averaged SGD step per batch of N trainer pushes."""

    def __init__(self, trainers: int, steps: int, lr: float) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.trainers, self.steps = trainers, steps
        # Guards the accumulate-then-step sequence: the step itself runs in a thread
        # (await), so another trainer's push could otherwise interleave with it.
        self.lock = asyncio.Lock()
        self.pushed = 0
        self.losses: list[float] = []  # mean trainer loss of each applied step
        self._batch_loss = 0.0
        self.future: asyncrpc.Future[list[torch.Tensor]] = asyncrpc.Future()

    def weights(self) -> list[torch.Tensor]:
        """A copy of the current parameters (the reply is pickled after we return)."""
        return [p.detach().clone() for p in self.model.parameters()]

    def _apply(self) -> None:
        for p in self.model.parameters():
            assert p.grad is not None
            p.grad /= self.trainers
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    async def push(self, grads: list[torch.Tensor], loss: float) -> asyncrpc.Future[Any]:
        """Add one trainer's gradients; the returned future completes after the batch step."""
        async with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
            self._batch_loss += loss
            self.pushed += 1
            future = self.future
            if self.pushed == self.trainers:
                await asyncio.to_thread(self._apply)
                self._record(self._batch_loss / self.trainers)
                self.pushed, self._batch_loss = 0, 0.0
                self.future = asyncrpc.Future()
                future.set_result(self.weights())
        return future

    def _record(self, loss: float) -> None:
        self.losses.append(loss)
        step = len(self.losses)
        print(f"{_bar(step, self.steps)} step {step:3d}/{self.steps}  loss {loss:.4f}", flush=True)


# -- functions the trainers call on the server (run on the owner of the RRef) ---------------


async def get_weights(ps_rref: asyncrpc.RRef[ParameterServer]) -> list[torch.Tensor]:
    """The server's current weights."""
    return ps_rref.local_value().weights()


@async_execution
async def update_and_fetch(
    ps_rref: asyncrpc.RRef[ParameterServer], grads: list[torch.Tensor], loss: float
) -> asyncrpc.Future[list[torch.Tensor]]:
    """Push gradients; reply with the weights once every trainer's step is applied."""
    return await ps_rref.local_value().push(grads, loss)


# -- the trainer: an async program on each trainer worker -----------------------------------


async def train(
    ps_rref: asyncrpc.RRef[ParameterServer], rank: int, steps: int, batch: int
) -> list[float]:
    """Run ``steps`` steps on this trainer's data shard; return its per-step losses."""
    model = make_model()
    x, y = make_data(rank, steps * batch)
    weights = await asyncrpc.call("ps", get_weights, ps_rref)
    losses = []
    for step in range(steps):
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights, strict=True):
                p.copy_(w)
        model.zero_grad()
        xb, yb = x[step * batch : (step + 1) * batch], y[step * batch : (step + 1) * batch]
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        weights = await asyncrpc.call("ps", update_and_fetch, ps_rref, grads, loss.item())
        losses.append(loss.item())
    return losses


def _options(args: argparse.Namespace, *, serves_whole_run: bool) -> asyncrpc.RpcBackendOptions:
    # A trainer is in its graceful shutdown from the moment it joins (``train`` is called
    # in, and runs the whole training): bounded by the run's deadline, not a call's timeout.
    return asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.timeout,
        shutdown_timeout=args.deadline if serves_whole_run else args.timeout,
    )


async def serve(args: argparse.Namespace) -> ParameterServer:
    """Rank 0: own the server, start every trainer's loop, wait for all of them."""
    world = args.trainers + 1
    options = _options(args, serves_whole_run=False)
    async with asyncrpc.worker("ps", rank=0, world_size=world, rpc_backend_options=options):
        server = ParameterServer(args.trainers, args.steps, args.lr)
        ps_rref = asyncrpc.RRef(server)
        await asyncio.gather(*(
            asyncrpc.call(f"trainer{r}", train, ps_rref, r, args.steps, args.batch)
            for r in range(1, world)
        ))  # fmt: skip
        del ps_rref
    return server


async def trainer_worker(args: argparse.Namespace) -> None:
    """Ranks 1..N: join the group and serve (``train`` is called in) until shutdown."""
    name, options = f"trainer{args.rank}", _options(args, serves_whole_run=True)
    async with asyncrpc.worker(name, rank=args.rank, world_size=args.world_size,
                               rpc_backend_options=options):  # fmt: skip
        pass


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.parameter_server")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=60.0, help="per call, and to join")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help="seconds for the whole run; past it the run is stopped")  # fmt: skip
    parser.add_argument("--json", help="write the final losses here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=0)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the example; exit 0 when the loss fell."""
    args = parse(argv)
    if args.role == "worker":
        asyncio.run(trainer_worker(args))
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    print(f"parameter server + {args.trainers} trainers, {args.steps} steps", flush=True)
    extra = ["--timeout", str(args.timeout), "--deadline", str(args.deadline)]
    ranks = range(1, args.trainers + 1)
    with workers(__name__, ranks, args.trainers + 1, args.init_method, extra, args.deadline):
        server = asyncio.run(serve(args))
    losses = server.losses
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    fell = last < first
    print(f"loss {first:.4f} -> {last:.4f} ({'fell' if fell else 'DID NOT FALL'}) "
          f"in {time.monotonic() - start:.1f}s", flush=True)  # fmt: skip
    write_json(args.json, {"losses": losses, "first": first, "last": last, "fell": fell})
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
