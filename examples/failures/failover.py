"""A trainer that re-routes to a standby server when its server hangs.

Rank 0 is the trainer; rank 1 ("primary") holds the model and copies every update to
rank 2 ("standby") before it answers. After ``--hang-at`` updates the primary stops
(SIGSTOP, as a machine that freezes): it has copied that update to the standby but never
answers. The trainer's call has no timeout; the heartbeat finds the primary silent and
declares it lost: within about 2.5 s where its process was seen to answer a probe before
(it then fails to), else once silent for ``silent_link_timeout`` (10 s). The primary here
freezes in its first second, before any probe could check it, so it takes the 10 s
(docs/reliability.md, "Liveness"); still well before the call's 60 s timeout. The trainer's
``asyncrpc.on_peer_lost`` callback switches it to the standby, and the failed update is
sent again there. Updates are numbered, so the standby applies each one once: the final
weights equal those of the same training in one process.

    python -m examples.failures.failover --steps 20 --hang-at 8
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time

import torch

import asyncrpc
from asyncrpc.testing import free_port
from examples._launch import DEADLINE_S, workers, write_json
from examples.parameter_server.ps import make_data, make_model

MODULE = "examples.failures.failover"  # its workers run it, and its functions pickle by it


class Replica:
    """A server's copy of the model and the number of the last update applied to it."""

    def __init__(self, lr: float) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.applied = 0
        self.lock = threading.Lock()

    def apply(self, step: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.lock:
            if step == self.applied + 1:  # a resent update that arrived already: once
                for param, grad in zip(self.model.parameters(), grads, strict=True):
                    param.grad = grad
                self.optimizer.step()
                self.applied = step
            return [p.detach().clone() for p in self.model.parameters()]


_REPLICA: Replica | None = None
_HANG_AT = 0


def update(step: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply update ``step`` here; the primary copies it to the standby first."""
    assert _REPLICA is not None
    if asyncrpc.get_worker_info().name == "primary":
        asyncrpc.rpc_sync("standby", update, args=(step, grads))
        if step == _HANG_AT:
            os.kill(os.getpid(), signal.SIGSTOP)  # this very process freezes, unanswered
    return _REPLICA.apply(step, grads)


def reference(args: argparse.Namespace) -> list[torch.Tensor]:
    """The same training in one process: the weights the standby must end with."""
    replica, model = Replica(args.lr), make_model()
    x, y = make_data(0, args.batch)
    for step in range(1, args.steps + 1):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        weights = replica.apply(step, [p.grad.detach().clone() for p in model.parameters()])
        with torch.no_grad():
            for param, value in zip(model.parameters(), weights, strict=True):
                param.copy_(value)
    return [p.detach() for p in replica.model.parameters()]


def train(args: argparse.Namespace) -> dict[str, object]:
    """The trainer (rank 0): every update goes to the current server, re-sent on a loss."""
    server = ["primary"]
    switched: list[float] = []

    def reroute(error: asyncrpc.PeerLostError) -> None:
        if error.worker == "primary":
            print(f"trainer: primary lost ({error.evidence}): on to the standby", flush=True)
            server[0] = "standby"
            switched.append(time.monotonic())

    asyncrpc.on_peer_lost(reroute)
    model = make_model()
    x, y = make_data(0, args.batch)
    sent_at, unanswered_at, failed = 0.0, 0.0, 0
    for step in range(1, args.steps + 1):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        sent_at = time.monotonic()
        for _ in range(3):  # bounded: a lost server is replaced once
            try:
                weights = asyncrpc.rpc_sync(server[0], update, args=(step, grads), timeout=0)
                break
            except asyncrpc.PeerLostError:
                failed += 1
                unanswered_at = sent_at  # when the update that never came back was sent
                time.sleep(0.01)  # the loss callback runs on the callback pool
        with torch.no_grad():
            for param, value in zip(model.parameters(), weights, strict=True):
                param.copy_(value)
    found_after = switched[0] - unanswered_at if switched and failed else None
    final = [p.detach() for p in model.parameters()]
    same = all(torch.allclose(a, b) for a, b in zip(final, reference(args), strict=True))
    return {"server": server[0], "failed_calls": failed, "found_after_s": found_after,
            "matches_one_process": same}  # fmt: skip


def serve(args: argparse.Namespace) -> None:
    global _REPLICA, _HANG_AT
    _REPLICA, _HANG_AT = Replica(args.lr), args.hang_at
    name = "primary" if args.rank == 1 else "standby"
    asyncrpc.init_rpc(name, rank=args.rank, world_size=3, rpc_backend_options=_options(args))
    asyncrpc.shutdown()


def _options(args: argparse.Namespace) -> asyncrpc.RpcBackendOptions:
    # The default heartbeat: a frozen worker is declared lost within about 2.5 s once a
    # probe has seen its process answer, else after 10 s of silence.
    return asyncrpc.RpcBackendOptions(init_method=args.init_method, rpc_timeout=args.timeout)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.failures.failover")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hang-at", type=int, default=8, help="the update the primary hangs in")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=DEADLINE_S)
    parser.add_argument("--json", help="write the outcome here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the example; exit 0 when the trainer finished on the standby with the weights
    of one process."""
    args = parse(argv)
    if args.role == "worker":
        serve(args)
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    print(f"trainer + primary + standby, {args.steps} updates; the primary hangs in update "
          f"{args.hang_at}", flush=True)  # fmt: skip
    extra = ["--hang-at", str(args.hang_at), "--lr", str(args.lr), "--timeout", str(args.timeout)]
    # The frozen primary never exits by itself: it is killed at the end, as expected.
    with workers(MODULE, [1, 2], 3, args.init_method, extra, args.deadline, exit_grace=10.0,
                 may_fail=[1]):  # fmt: skip
        asyncrpc.init_rpc("trainer", rank=0, world_size=3, rpc_backend_options=_options(args))
        outcome = train(args)
        asyncrpc.shutdown()
    print(f"finished on the {outcome['server']} after {outcome['failed_calls']} failed call(s); "
          f"primary found lost {outcome['found_after_s']:.2f} s after the unanswered update; "
          f"weights match one process: {outcome['matches_one_process']} "
          f"({time.monotonic() - started:.1f}s)", flush=True)  # fmt: skip
    write_json(args.json, outcome)
    ok = outcome["server"] == "standby" and outcome["matches_one_process"] is True
    return 0 if ok else 1


if __name__ == "__main__":
    # Run as the module proper, not as __main__: the functions called remotely are
    # pickled by their module's name, which every worker imports.
    sys.exit(importlib.import_module(MODULE).main())
