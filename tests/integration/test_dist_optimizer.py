"""``DistributedOptimizer`` with real worker processes over 127.0.0.1: steps equal local
SGD's, run on the loop or the lanes where they may, and one at a time over shared
parameters.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.errors import BlockingCallError
from asyncrpc.optim import DistributedOptimizer, LocalOptimizer
from asyncrpc.runtime.current import current_agent
from tests.integration import autograd_fns as fns
from tests.integration.autograd_support import open_lanes
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(90)


def test_distributed_optimizer_matches_local_sgd(group: Group, layers: Callable) -> None:
    l1, l2 = layers("w1", 11, 4, 6), layers("w3", 12, 6, 1)
    params = asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(l1,))
    params += asyncrpc.rpc_sync("w3", fns.param_rrefs, args=(l2,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    m1, m2 = fns.make_linear(11, 4, 6), fns.make_linear(12, 6, 1)
    local = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.05, momentum=0.9)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    for x, target in batches:
        with dist_autograd.context() as context_id:
            h = asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x))
            y = asyncrpc.rpc_sync("w3", fns.forward, args=(l2, torch.relu(h)))
            dist_autograd.backward(context_id, [(y - target).pow(2).mean()])
            optimizer.step(context_id)
        local.zero_grad()
        (m2(torch.relu(m1(x))) - target).pow(2).mean().backward()
        local.step()
    for worker, rref, module in (("w1", l1, m1), ("w3", l2, m2)):
        remote_weights = asyncrpc.rpc_sync(worker, fns.weights, args=(rref,))
        for got, want in zip(remote_weights, module.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())
    del params, optimizer


def test_distributed_optimizer_steps_on_the_loop_unless_user_code_runs(
    group: Group, layers: Callable
) -> None:
    layer = layers("w1", 41, 4, 2)
    params = asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(layer,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)

    def train_step(optimizer: DistributedOptimizer) -> None:
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, torch.randn(3, 4)))
            dist_autograd.backward(context_id, [y.sum()])
            # The loop's way (step() would take this thread's lane to w1: the next test).
            for done in optimizer.step_future(context_id):
                done.wait()

    start = asyncrpc.rpc_sync("w1", fns.steps_on_loop)
    train_step(optimizer)  # torch's SGD over 10 elements, no hooks: on w1's loop
    assert asyncrpc.rpc_sync("w1", fns.steps_on_loop) == start + 1
    asyncrpc.rpc_sync("w1", fns.hook_optimizer_steps)
    try:
        train_step(optimizer)  # a step hook is user code: the step runs on a pool thread
    finally:
        seen = asyncrpc.rpc_sync("w1", fns.unhook_optimizer_steps)
    assert seen == [False]
    assert asyncrpc.rpc_sync("w1", fns.steps_on_loop) == start + 1
    del params, optimizer


def test_distributed_optimizer_steps_its_own_here_and_one_owner_on_the_lane(
    group: Group, layers: Callable
) -> None:
    # This thread's own optimizer steps on this thread; w1's on this thread's lane to w1
    # (open: this thread called w1 before), run by w1's lane thread, hooks and all.
    here, there = fns.make_linear(31, 4, 6), layers("w1", 32, 6, 1)
    params = [asyncrpc.RRef(p) for p in here.parameters()]
    params += asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(there,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    before = [LocalOptimizer.steps_here, asyncrpc.rpc_sync("w1", fns.steps_here)]
    loop_steps = asyncrpc.rpc_sync("w1", fns.steps_on_loop)
    asyncrpc.rpc_sync("w1", fns.hook_optimizer_steps)
    try:
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.forward, args=(there, here(torch.randn(3, 4))))
            dist_autograd.backward(context_id, [y.sum()])
            optimizer.step(context_id)
    finally:
        seen = asyncrpc.rpc_sync("w1", fns.unhook_optimizer_steps)
    after = [LocalOptimizer.steps_here, asyncrpc.rpc_sync("w1", fns.steps_here)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    assert asyncrpc.rpc_sync("w1", fns.steps_on_loop) == loop_steps
    assert seen == [False]  # the hook ran on w1, not on its loop
    del params, optimizer


def test_distributed_optimizer_steps_several_owners_at_once_on_the_lanes(
    group: Group, layers: Callable
) -> None:
    # Two other owners: both steps are written on this thread's lanes (w1's, then w3's)
    # before either reply is read, so their lane threads step them at once; none on a
    # loop. The weights are those one process's SGD gives.
    l1, l3 = layers("w1", 41, 4, 6), layers("w3", 42, 6, 1)
    open_lanes("w1", "w3")
    params = asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(l1,))
    params += asyncrpc.rpc_sync("w3", fns.param_rrefs, args=(l3,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    before = [asyncrpc.rpc_sync(w, f) for w, f in _STEP_COUNTS]
    x = torch.randn(3, 4)
    with dist_autograd.context() as context_id:
        h = asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x))
        y = asyncrpc.rpc_sync("w3", fns.forward, args=(l3, h))
        dist_autograd.backward(context_id, [y.sum()])
        optimizer.step(context_id)
    after = [asyncrpc.rpc_sync(w, f) for w, f in _STEP_COUNTS]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 1, 0, 1]
    m1, m3 = fns.make_linear(41, 4, 6), fns.make_linear(42, 6, 1)
    local = torch.optim.SGD([*m1.parameters(), *m3.parameters()], lr=0.1)
    m3(m1(x)).sum().backward()
    local.step()
    for got, want in zip(
        [*asyncrpc.rpc_sync("w1", fns.weights, args=(l1,)),
         *asyncrpc.rpc_sync("w3", fns.weights, args=(l3,))],
        [*m1.parameters(), *m3.parameters()],
        strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(got, want.detach())
    del params, optimizer


# (worker, its count): w1's steps on its loop and on threads that waited, then w3's.
_STEP_COUNTS = [
    ("w1", fns.steps_on_loop), ("w1", fns.steps_here),
    ("w3", fns.steps_on_loop), ("w3", fns.steps_here),
]  # fmt: skip


def test_distributed_optimizer_step_refuses_the_loop_thread(group: Group) -> None:
    optimizer = DistributedOptimizer(torch.optim.SGD, [asyncrpc.RRef(torch.ones(2))], lr=0.1)

    async def on_the_loop() -> None:
        optimizer.step(0)

    with pytest.raises(BlockingCallError):
        asyncio.run_coroutine_threadsafe(on_the_loop(), current_agent().loop.aio).result(30)


def test_distributed_optimizers_of_several_trainers_step_shared_params_one_at_a_time(
    group: Group, layers: Callable
) -> None:
    """A parameter server's pattern: each trainer's DistributedOptimizer has an optimizer
    of its own on the owner, over the same parameters. Their steps must not interleave
    (each sets .grad to its own context's gradients, then steps): with plain SGD the final
    weights are the initial ones minus lr times the sum of every trainer's gradients."""
    layer = layers("w1", 31, 3, 1)
    initial = asyncrpc.rpc_sync("w1", fns.weights, args=(layer,))
    trainers, steps, lr = 4, 12, 0.01
    grads: list[list[torch.Tensor]] = []
    failures: list[BaseException] = []
    start = threading.Barrier(trainers, timeout=30)

    def train(seed: int) -> None:
        try:
            params = asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(layer,))
            optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=lr)
            start.wait()
            for step in range(steps):
                x = torch.full((2, 3), float(seed + step))
                with dist_autograd.context() as context_id:
                    y = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x))
                    dist_autograd.backward(context_id, [y.sum()])
                    grads.append([x.sum(0, keepdim=True), torch.tensor([2.0])])
                    optimizer.step(context_id)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=train, args=(t + 1,)) for t in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert len(grads) == trainers * steps
    final = asyncrpc.rpc_sync("w1", fns.weights, args=(layer,))
    for index, (got, before) in enumerate(zip(final, initial, strict=True)):
        total = torch.stack([g[index] for g in grads]).sum(0)
        torch.testing.assert_close(got, before - lr * total)


def test_distributed_optimizer_constructor_raises_the_owners_error(
    group: Group, layers: Callable
) -> None:
    """As torch's: building waits for every owner, so its failure raises here, typed."""
    params = asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(layers("w1", 13, 2, 2),))
    with pytest.raises(ValueError, match=r"no optimizer with lr=0\.5"):
        DistributedOptimizer(fns.FailingOptimizer, params, lr=0.5)
    del params


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_distributed_optimizer_over_local_and_remote_parameters(
    group: Group, layers: Callable, mode: str
) -> None:
    """torch's RNN tutorial: the caller's own RRef(p)s beside a remote module's, one
    optimizer (its local part made by a remote() to oneself, holding a lock)."""
    here, there = fns.make_linear(21, 4, 6), layers("w1", 22, 6, 1)
    params = [asyncrpc.RRef(p) for p in here.parameters()]
    params += asyncrpc.rpc_sync("w1", fns.param_rrefs, args=(there,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    m1, m2 = fns.make_linear(21, 4, 6), fns.make_linear(22, 6, 1)
    local = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.05, momentum=0.9)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

    async def step_async(
        optimizer: DistributedOptimizer, x: torch.Tensor, target: torch.Tensor
    ) -> None:
        async with dist_autograd.context() as context_id:
            y = await asyncrpc.call("w1", fns.forward, there, torch.relu(here(x)))
            await dist_autograd.backward_async(context_id, [(y - target).pow(2).mean()])
            for done in optimizer.step_future(context_id):
                await done

    for x, target in batches:
        if mode == "async":
            asyncio.run(step_async(optimizer, x, target))
        else:
            with dist_autograd.context() as context_id:
                y = asyncrpc.rpc_sync("w1", fns.forward, args=(there, torch.relu(here(x))))
                dist_autograd.backward(context_id, [(y - target).pow(2).mean()])
                optimizer.step(context_id)
        local.zero_grad()
        (m2(torch.relu(m1(x))) - target).pow(2).mean().backward()
        local.step()
    for got, want in zip(here.parameters(), m1.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach())
        assert got.grad is None  # distributed gradients never land in .grad
    remote_weights = asyncrpc.rpc_sync("w1", fns.weights, args=(there,))
    for got, want in zip(remote_weights, m2.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach())
    del params, optimizer
