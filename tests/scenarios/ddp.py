"""Scenarios of DDP inside distributed autograd (test layer): one rank of the DDP + RPC
hybrid training test, and the concurrent-contexts check.

``ddp_hybrid --rank R --pg-port P --steps S1,S2 --out FILE``: rank 0 ("ps") holds a shared
layer; ranks 1 and 2 ("t1", "t2") each hold a local layer wrapped in
DistributedDataParallel over a gloo group of the two trainers. A step: the trainer sends
its batch through the ps's layer, then its DDP layer, runs distributed backward, and steps
a DistributedOptimizer over both layers' parameters. ``S1,S2`` are the trainers' step
counts; when they differ, the loop runs inside ``ddp.join()`` (uneven inputs). The steps
are ordered by a barrier on the ps (an RPC, not a collective: a gloo barrier would not be
shadowed by ``join``), so the result is that of single-process training, which the test
computes (``reference``).

``ddp_concurrent --pg-port P --out FILE`` (beside ``ddp_serve``): one worker with a process
group (so passes run on torch's engine) runs contexts on several threads at once through
one local layer and a remote one; each context's gradients must be those of its own batch
alone.

``ddp_teardown --rank R --pg-port P`` (two ranks): rank 0 destroys its gloo group and drops
its DDP module while an all-reduce it started is in flight, and only then asks rank 1 to
take part in it. torch's reducer, dropping the group's last reference, would tear the group
down on rank 0's thread with the GIL held, waiting for that all-reduce for good; asyncrpc
keeps the group and lets it go later on a thread of its own.

``ddp_hybrid`` and ``ddp_concurrent`` write their results as ``torch.save`` to ``--out``.
The test imports this module for ``reference`` and ``concurrent_reference``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

# Imported before any group exists: its functions take ``group=group.WORLD`` as a default,
# read at import, so importing it later (DDP's constructor does) pins the default group for
# good, and ``ddp_teardown`` would never see a reducer hold the group's last reference.
import torch.distributed.nn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.autograd.groups import kept_groups
from asyncrpc.optim import DistributedOptimizer
from tests.scenarios.common import options, poll, report
from tests.scenarios.registry import option, scenario

LR = 0.1
IN, HIDDEN, OUT_FEATURES = 3, 4, 2
SHARED_SEED, LOCAL_SEED = 11, 22

_shared: nn.Module | None = None
_arrived: dict[str, int] = defaultdict(int)
_changed: asyncio.Condition | None = None


def batch(step: int, trainer: int) -> torch.Tensor:
    """The batch of ``trainer`` (1 or 2) at ``step``: the same in every process."""
    return torch.randn(5, IN, generator=torch.Generator().manual_seed(100 * step + trainer))


def make_layers() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(SHARED_SEED)
    shared = nn.Linear(IN, HIDDEN)
    torch.manual_seed(LOCAL_SEED)
    return shared, nn.Linear(HIDDEN, OUT_FEATURES)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


# -- run on the ps ---------------------------------------------------------------------


def shared_layer() -> nn.Module:
    """The ps's shared layer (remote() to it returns an RRef to this one object)."""
    assert _shared is not None
    return _shared


def shared_forward(x: torch.Tensor) -> torch.Tensor:
    assert _shared is not None
    return torch.relu(_shared(x))


def shared_params() -> list[asyncrpc.RRef[torch.Tensor]]:
    assert _shared is not None
    return [asyncrpc.RRef(p) for p in _shared.parameters()]


def shared_weights() -> list[torch.Tensor]:
    assert _shared is not None
    return [p.detach().clone() for p in _shared.parameters()]


async def arrive(tag: str, expected: int) -> None:
    """A barrier on the ps: returns once ``expected`` trainers arrived at ``tag``."""
    global _changed
    if _changed is None:
        _changed = asyncio.Condition()
    async with _changed:
        _arrived[tag] += 1
        _changed.notify_all()
        await asyncio.wait_for(_changed.wait_for(lambda: _arrived[tag] >= expected), 60)


# -- the trainers ----------------------------------------------------------------------


def train(rank: int, pg_port: int, steps: tuple[int, int]) -> dict[str, object]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank - 1, world_size=2
    )
    _, local = make_layers()
    ddp = DistributedDataParallel(local)
    params = asyncrpc.rpc_sync("ps", shared_params)
    params += [asyncrpc.RRef(p) for p in local.parameters()]
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    losses: list[float] = []
    with ddp.join(enable=steps[0] != steps[1]):
        for step in range(steps[rank - 1]):
            # Trainers still training at this step: the barrier waits for those only.
            expected = sum(1 for n in steps if n > step)
            with dist_autograd.context() as context_id:
                hidden = asyncrpc.rpc_sync("ps", shared_forward, args=(batch(step, rank),))
                loss = loss_of(ddp(hidden))
                dist_autograd.backward(context_id, [loss])
                asyncrpc.rpc_sync("ps", arrive, args=(f"grads{step}", expected))
                optimizer.step(context_id)
                asyncrpc.rpc_sync("ps", arrive, args=(f"stepped{step}", expected))
            losses.append(loss.item())
    weights = [p.detach().clone() for p in local.parameters()]
    dist.destroy_process_group()
    return {"losses": losses, "local": weights}


_PG_PORT = option("--pg-port", type=int, required=True)
_OUT = option("--out", required=True)
_DEFAULTS = {"rpc_timeout": 60.0, "shutdown_timeout": 60.0}


@scenario("ddp_hybrid", _PG_PORT, _OUT, option("--steps", required=True), **_DEFAULTS)
def hybrid(args: argparse.Namespace) -> int:
    """One rank (``--rank``) of {ps, t1, t2} training the hybrid model ``--steps S1,S2``."""
    global _shared
    rank, pg_port, out = args.rank, args.pg_port, args.out
    s1, s2 = (int(n) for n in args.steps.split(","))
    name = "ps" if rank == 0 else f"t{rank}"
    if rank == 0:
        _shared, _ = make_layers()
    asyncrpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=options(args))
    result: dict[str, object] = {}
    if rank != 0:
        result = train(rank, pg_port, (s1, s2))
        if rank == 1:
            result["shared"] = asyncrpc.rpc_sync("ps", shared_weights)
    asyncrpc.shutdown()
    torch.save(result, out)
    report({"out": out})
    return 0


def reference(steps: tuple[int, int]) -> dict[str, object]:
    """Single-process training equal to the hybrid run: both trainers' gradients of the
    shared layer add up (each steps it from its own context); the local layer's are
    averaged over both trainers (DDP divides by the initial world size, and a trainer
    that has joined adds zeros)."""
    shared, local = make_layers()
    losses: dict[int, list[float]] = {1: [], 2: []}
    for step in range(max(steps)):
        shared.zero_grad()
        local.zero_grad()
        for trainer in (1, 2):
            if step < steps[trainer - 1]:
                loss = loss_of(local(torch.relu(shared(batch(step, trainer)))))
                loss.backward()  # type: ignore[no-untyped-call]
                losses[trainer].append(loss.item())
        with torch.no_grad():
            for p in shared.parameters():
                p.sub_(LR * p.grad)  # type: ignore[operator]
            for p in local.parameters():
                p.sub_(LR * p.grad / 2)  # type: ignore[operator]
    return {
        "losses": losses,
        "local": [p.detach().clone() for p in local.parameters()],
        "shared": [p.detach().clone() for p in shared.parameters()],
    }


# -- concurrent contexts on one worker -------------------------------------------------

THREADS = 4


@scenario("ddp_concurrent", _PG_PORT, _OUT, **_DEFAULTS)
def concurrent(args: argparse.Namespace) -> int:
    """Rank 0 of two ("c0"; rank 1 "c1" serves): contexts on THREADS threads at once."""
    asyncrpc.init_rpc("c0", rank=0, world_size=2, rpc_backend_options=options(args))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.pg_port}", rank=0, world_size=1
    )
    _, local = make_layers()
    start = threading.Barrier(THREADS, timeout=30)
    grads: dict[int, list[torch.Tensor]] = {}

    def one(trainer: int) -> None:
        x = batch(0, trainer)
        with dist_autograd.context() as context_id:
            hidden = asyncrpc.rpc_sync("c1", shared_forward, args=(x,))
            loss = loss_of(local(hidden))
            start.wait()  # the backward passes overlap
            dist_autograd.backward(context_id, [loss])
            found = dist_autograd.get_gradients(context_id)
            grads[trainer] = [found[p] for p in local.parameters()]

    threads = [threading.Thread(target=one, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    leaked = [p.grad is not None for p in local.parameters()]
    dist.destroy_process_group()
    asyncrpc.shutdown()
    torch.save({"grads": grads, "grad_set": leaked}, args.out)
    report({"out": args.out})
    return 0


@scenario("ddp_serve", **_DEFAULTS)
def serve_concurrent(args: argparse.Namespace) -> int:
    """Rank 1 of two ("c1"): holds the shared layer and serves ``ddp_concurrent``."""
    global _shared
    _shared, _ = make_layers()
    asyncrpc.init_rpc("c1", rank=1, world_size=2, rpc_backend_options=options(args))
    asyncrpc.shutdown()
    report({})
    return 0


def concurrent_reference() -> dict[int, list[torch.Tensor]]:
    shared, local = make_layers()
    expected = {}
    for trainer in range(THREADS):
        local.zero_grad()
        loss_of(local(torch.relu(shared(batch(0, trainer))))).backward()  # type: ignore[no-untyped-call]
        expected[trainer] = [p.grad.clone() for p in local.parameters()]  # type: ignore[union-attr]
    return expected


# -- a DDP module dropped after its group was destroyed --------------------------------

_go = threading.Event()


def go() -> None:
    """Run on "d1": "d0" has dropped its DDP module; take part in its all-reduce now."""
    _go.set()


@scenario("ddp_teardown", _PG_PORT, **_DEFAULTS)
def teardown(args: argparse.Namespace) -> int:
    """Rank ``--rank`` of two ("d0", "d1"): d0 destroys its group and drops its DDP module
    while an all-reduce is in flight, which d1 takes part in only after that."""
    rank = args.rank
    asyncrpc.init_rpc(f"d{rank}", rank=rank, world_size=2, rpc_backend_options=options(args))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.pg_port}", rank=rank, world_size=2
    )
    ddp = DistributedDataParallel(nn.Linear(IN, OUT_FEATURES))
    with dist_autograd.context() as context_id:  # a pass on torch's engine, feeding DDP
        dist_autograd.backward(context_id, [loss_of(ddp(batch(0, rank + 1)))])
    observed: dict[str, object] = {}
    if rank == 0:
        # As DDP's join() does: an all-reduce of a tensor made in Python, its handle
        # dropped. It stays in flight until d1 takes part, after the module is gone.
        dist.all_reduce(torch.ones(1), async_op=True)
        dist.destroy_process_group()
        del ddp
        gc.collect()  # the module sits in a reference cycle: it is freed here
        asyncrpc.rpc_sync("d1", go)
        observed["let_go"] = poll(lambda: kept_groups() == 0, 30)
    else:
        observed["took_part"] = _go.wait(60)
        if observed["took_part"]:
            dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
    asyncrpc.shutdown()
    report(observed)
    return 0
