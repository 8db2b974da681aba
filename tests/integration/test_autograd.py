"""Distributed autograd with real worker processes over 127.0.0.1: gradients equal
single-process autograd, contexts are released everywhere, failures reach the caller.

The driver (this process) runs forward and backward; w1 and w3 serve on thread pools, w2
on its event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.errors import AutogradContextError, BackwardError, BlockingCallError
from asyncrpc.optim import DistributedOptimizer, LocalOptimizer
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.runtime.calls.pipeline import CallKind, Pipeline
from asyncrpc.runtime.current import current_agent
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.integration import autograd_fns as fns
from tests.integration.conftest import WORLD, Group
from tests.ordering import until

pytestmark = pytest.mark.timeout(90)

WORKERS = [f"w{r}" for r in range(1, WORLD)]


def contexts_everywhere() -> list[int]:
    """Contexts per worker, asked from a thread of its own: calls made inside a context
    would make the workers they reach join it."""
    counts: list[int] = []

    def ask() -> None:
        counts.append(int(asyncrpc.get_debug_info()["num_autograd_contexts"]))
        counts.extend(asyncrpc.rpc_sync(w, fns.num_contexts) for w in WORKERS)

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join(30)
    return counts


def contexts_settle_at(expected: list[int], timeout: float = 10.0) -> list[int]:
    """Contexts per worker once the background releases are done (polled, bounded)."""
    deadline = time.monotonic() + timeout
    counts = contexts_everywhere()
    while counts != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        counts = contexts_everywhere()
    return counts


def assert_grads_match(
    context_id: int, remote: list[tuple[str, asyncrpc.RRef[nn.Module]]], local: list[nn.Module]
) -> None:
    for (worker, rref), module in zip(remote, local, strict=True):
        grads = asyncrpc.rpc_sync(worker, fns.grads_of, args=(context_id, rref))
        for grad, param in zip(grads, module.parameters(), strict=True):
            assert grad is not None
            assert param.grad is not None
            torch.testing.assert_close(grad, param.grad)


@pytest.fixture
def layers(group: Group) -> Iterator[Callable[[str, int, int, int], asyncrpc.RRef[nn.Module]]]:
    made: list[asyncrpc.RRef[nn.Module]] = []

    def make(worker: str, seed: int, n_in: int, n_out: int) -> asyncrpc.RRef[nn.Module]:
        rref = asyncrpc.remote(worker, fns.make_linear, args=(seed, n_in, n_out))
        # Made before use: an async def on the owner (async_forward) cannot wait in
        # local_value() for a value still being made (it raises BlockingCallError).
        rref._get_future().wait()
        made.append(rref)
        return rref

    yield make
    del made[:]
    assert contexts_settle_at([0] * WORLD) == [0] * WORLD


def test_autograd_mlp_split_over_two_workers(group: Group, layers: Callable) -> None:
    l1, l2 = layers("w1", 1, 4, 8), layers("w2", 2, 8, 3)
    x = torch.randn(5, 4)
    with dist_autograd.context() as context_id:
        h = asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x))
        y = asyncrpc.rpc_sync("w2", fns.async_forward, args=(l2, h))  # an async def forward
        dist_autograd.backward(context_id, [y.pow(2).sum()])
        m1, m2 = fns.make_linear(1, 4, 8), fns.make_linear(2, 8, 3)
        torch.tanh(m2(m1(x))).pow(2).sum().backward()
        assert_grads_match(context_id, [("w1", l1), ("w2", l2)], [m1, m2])
        assert contexts_everywhere() == [1, 1, 1, 0]  # w3 never saw this context
        # Per context only: nothing went into .grad on the owners.
        assert asyncrpc.rpc_sync("w1", fns.params_have_no_grad, args=(l1,))
    assert contexts_settle_at([0] * WORLD) == [0] * WORLD  # released on every worker


def test_autograd_micro_batches_to_one_worker_take_one_hop(group: Group, layers: Callable) -> None:
    # Three micro-batches through w1's layer, then w2's: backward reaches each worker once
    # (its gradients batched into one hop), with the gradients of three separate passes.
    l1, l2 = layers("w1", 6, 4, 5), layers("w2", 7, 5, 2)
    batches = [torch.randn(3, 4) for _ in range(3)]
    hops_before = [asyncrpc.rpc_sync(w, fns.hops_received) for w in ("w1", "w2")]
    with dist_autograd.context() as context_id:
        outs = [
            asyncrpc.rpc_sync(
                "w2", fns.forward, args=(l2, asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x)))
            )
            for x in batches
        ]
        dist_autograd.backward(context_id, [torch.stack(outs).pow(2).sum()])
        m1, m2 = fns.make_linear(6, 4, 5), fns.make_linear(7, 5, 2)
        torch.stack([m2(m1(x)) for x in batches]).pow(2).sum().backward()
        assert_grads_match(context_id, [("w1", l1), ("w2", l2)], [m1, m2])
    hops = [
        asyncrpc.rpc_sync(w, fns.hops_received) - n
        for w, n in zip(("w1", "w2"), hops_before, strict=True)
    ]
    assert hops == [1, 1]


def test_autograd_small_passes_run_on_the_loop_user_code_on_the_pool(
    group: Group, layers: Callable
) -> None:
    # w1's pass is a plain layer: it runs on w1's loop. w3's graph holds a tensor hook that
    # makes a blocking call (user code): it runs on a pool thread, where that works. The
    # hops go the loops' way: backward_async (backward() from this thread would send them
    # on its lanes, and the lanes' threads would run both passes).
    l1, l3 = layers("w1", 31, 4, 6), layers("w3", 32, 6, 2)
    before = [asyncrpc.rpc_sync(w, fns.passes_on_loop) for w in ("w1", "w3")]
    x = torch.randn(5, 4)
    with dist_autograd.context() as context_id:
        h = asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x))
        y = asyncrpc.rpc_sync("w3", fns.forward_hooked_by_peer, args=(l3, torch.relu(h), "w2"))
        asyncio.run(dist_autograd.backward_async(context_id, [y.pow(2).sum()]))
        m1, m3 = fns.make_linear(31, 4, 6), fns.make_linear(32, 6, 2)
        out = m3(torch.relu(m1(x)))
        out.register_hook(lambda grad: grad * fns.scale_factor())
        out.pow(2).sum().backward()
        assert_grads_match(context_id, [("w1", l1), ("w3", l3)], [m1, m3])
    after = [asyncrpc.rpc_sync(w, fns.passes_on_loop) for w in ("w1", "w3")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0]


def test_autograd_three_worker_chain_nested(group: Group, layers: Callable) -> None:
    l1, l3 = layers("w1", 3, 4, 6), layers("w3", 4, 6, 2)
    x = torch.randn(3, 4, requires_grad=True)  # the driver's own leaf takes part too
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", fns.forward_then, args=(l1, x, "w3", l3))
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
        m1, m3 = fns.make_linear(3, 4, 6), fns.make_linear(4, 6, 2)
        x_local = x.detach().clone().requires_grad_()
        m3(torch.relu(m1(x_local))).sum().backward()
        assert_grads_match(context_id, [("w1", l1), ("w3", l3)], [m1, m3])
        torch.testing.assert_close(grads[x], x_local.grad)
        assert x.grad is None


@pytest.mark.parametrize("shape", ["x requires grad", "x does not", "w3 ends it"])
def test_autograd_chain_hands_its_credit_back_to_the_root(
    group: Group, layers: Callable, shape: str
) -> None:
    # driver -> w1 -> w3, then back to w1 (and to the driver when x requires grad): w3's
    # gradients for w1 ride in its reply, and the last pass ends on the driver (its credit
    # handed back here, locally) or on w1, whose reply to the driver carries the credit.
    # Where the pass ends on w3 (w1 sent it a tensor cut from its graph), w3 hands the
    # credit back in a call of its own; the replies (w3's to w1, then w1's to the driver)
    # may end the driver's backward first, the pass being over by then: that call then
    # comes after the pass ended.
    l1, l3 = layers("w1", 5, 4, 6), layers("w3", 6, 6, 2)
    x = torch.randn(3, 4, requires_grad=shape == "x requires grad")
    info = asyncrpc.get_debug_info
    by_credit, by_call = info()["autograd_passes_over_by_credit"], info()["autograd_credit_calls"]
    forward_then = fns.forward_then_detached if shape == "w3 ends it" else fns.forward_then
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", forward_then, args=(l1, x, "w3", l3))
        dist_autograd.backward(context_id, [y.sum()])
        m1, m3 = fns.make_linear(5, 4, 6), fns.make_linear(6, 6, 2)
        if shape == "w3 ends it":
            (m3(torch.relu(m1(x)).detach()) * 2).sum().backward()
            assert_grads_match(context_id, [("w3", l3)], [m3])
        else:
            m3(torch.relu(m1(x.detach()))).sum().backward()
            assert_grads_match(context_id, [("w1", l1), ("w3", l3)], [m1, m3])
    calls = 1 if shape == "w3 ends it" else 0
    until(lambda: info()["autograd_credit_calls"] == by_call + calls, what="w3's credit call")
    assert info()["autograd_credit_calls"] == by_call + calls
    over_by_credit = info()["autograd_passes_over_by_credit"] - by_credit
    assert over_by_credit in ((0, 1) if shape == "w3 ends it" else (1,))


def test_autograd_rref_proxy_forward_and_parameter_used_twice(
    group: Group, layers: Callable
) -> None:
    layer = layers("w3", 5, 4, 4)
    x = torch.randn(2, 4)
    with dist_autograd.context() as context_id:
        h = layer.rpc_sync().forward(x)  # a remote forward through the RRef's proxy
        y = layer.rpc_async().forward(h).wait()  # the same parameters a second time
        dist_autograd.backward(context_id, [y.sum()])
        local = fns.make_linear(5, 4, 4)
        local(local(x)).sum().backward()
        assert_grads_match(context_id, [("w3", layer)], [local])


def test_autograd_same_tensor_twice_in_one_call(group: Group) -> None:
    a = torch.randn(3, requires_grad=True)  # small: still sent as a segment, once
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", fns.product, args=(a, a))
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    a_local = a.detach().clone().requires_grad_()
    fns.product(a_local, a_local).sum().backward()
    torch.testing.assert_close(grads[a], a_local.grad)


def test_autograd_echo_returns_the_gradient_to_its_owner(group: Group) -> None:
    a = torch.randn(4, requires_grad=True)
    with dist_autograd.context() as context_id:
        back = asyncrpc.rpc_sync("w2", fns.echo, args=(a,))  # a leaf on w2, sent back
        dist_autograd.backward(context_id, [(back * 3).sum()])
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[a], torch.full((4,), 3.0)
        )


def test_autograd_hops_back_to_the_root_run_on_the_thread_in_backward(
    group: Group, layers: Callable
) -> None:
    # x's gradient comes back from w1 in a hop of the pass this thread is the root of: the
    # thread waiting in backward() runs its pass, so x's hook (user code) runs there.
    layer = layers("w1", 41, 4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    seen: list[int] = []
    x.register_hook(lambda grad: seen.append(threading.get_ident()))
    info = asyncrpc.get_debug_info
    counts = ("autograd_hops_taken_by_root", "autograd_root_hops_on_lane")
    before = [info()[name] for name in counts]
    received = info()["autograd_hops_received"]
    with dist_autograd.context() as context_id:
        loss = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x)).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    assert seen == [threading.get_ident()]
    # Taken from the loop, or read by the thread itself from its lane to w1.
    assert sum(info()[name] - n for name, n in zip(counts, before, strict=True)) == 1
    # x's gradient came back in the reply to the driver's hop, not in a hop of its own.
    assert info()["autograd_hops_received"] == received
    x_local = x.detach().clone().requires_grad_()
    fns.make_linear(41, 4, 3)(x_local).pow(2).sum().backward()
    torch.testing.assert_close(grads[x], x_local.grad)


def test_autograd_root_thread_sends_its_hop_on_its_lane_even_when_a_hop_comes_back(
    group: Group, layers: Callable
) -> None:
    # This thread's lane to w1 is open (its second call there opens it): its hop goes on
    # it, and the thread blocks there while w1 -> w3 -> w1 -> driver run. The hop that
    # comes back here meanwhile runs on the loop (the thread is away): no deadlock.
    def on_a_thread_of_its_own() -> list[int]:
        l1, l3 = layers("w1", 51, 4, 6), layers("w3", 52, 6, 2)
        asyncrpc.rpc_sync("w1", fns.num_contexts)
        asyncrpc.rpc_sync("w1", fns.num_contexts)
        info = asyncrpc.get_debug_info
        names = ("autograd_root_hops_on_lane", "autograd_hops_received")
        before = [info()[name] for name in names]
        x = torch.randn(3, 4, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.forward_then, args=(l1, x, "w3", l3))
            dist_autograd.backward(context_id, [y.pow(2).sum()])
            grads = dist_autograd.get_gradients(context_id)
            m1, m3 = fns.make_linear(51, 4, 6), fns.make_linear(52, 6, 2)
            x_local = x.detach().clone().requires_grad_()
            m3(torch.relu(m1(x_local))).pow(2).sum().backward()
            assert_grads_match(context_id, [("w1", l1), ("w3", l3)], [m1, m3])
            torch.testing.assert_close(grads[x], x_local.grad)
        return [info()[name] - n for name, n in zip(names, before, strict=True)]

    out: list[list[int]] = []
    thread = threading.Thread(target=lambda: out.append(on_a_thread_of_its_own()))
    thread.start()
    thread.join(60)
    assert out == [[1, 1]]  # on the lane; x's gradient came in a hop of its own (from w1)


def on_a_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (its own lanes, opened by its own calls); its result, or
    its error raised here."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # raised by the test's own thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("rows", [32, 256], ids=["inline", "segment"])
def test_autograd_root_hop_on_a_lane_travels_coded(
    group: Group, layers: Callable, rows: int
) -> None:
    # The hop on this thread's lane to w1 and its reply (x's gradient, 8 KiB inline or
    # 64 KiB in a segment) go in the hop's own format, not pickled: w1 counts a coded call,
    # and the gradients are those of the same model run here. w1 planned its pass when it
    # wrote the forward's reply (on its lane thread), and ran it as planned. Then an error
    # in w1's pass arrives through it with its type.
    def on_a_thread_of_its_own() -> None:
        layer = layers("w1", 61, 64, 64)
        for _ in range(2):  # the second call opens this thread's lane to w1
            asyncrpc.rpc_sync("w1", fns.num_contexts)
        before = asyncrpc.rpc_sync("w1", fns.coded_calls_received)
        planned = asyncrpc.rpc_sync("w1", fns.passes_planned)
        x = torch.randn(rows, 64, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x))
            dist_autograd.backward(context_id, [y.pow(2).sum()])
            m1 = fns.make_linear(61, 64, 64)
            x_local = x.detach().clone().requires_grad_()
            m1(x_local).pow(2).sum().backward()
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x_local.grad)
            assert_grads_match(context_id, [("w1", layer)], [m1])
        assert asyncrpc.rpc_sync("w1", fns.coded_calls_received) - before == 1
        assert asyncrpc.rpc_sync("w1", fns.passes_planned) - planned == 1
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.fail_in_backward, args=(x,))
            with pytest.raises(KeyError, match="broken backward"):
                dist_autograd.backward(context_id, [y.sum()])
        assert asyncrpc.rpc_sync("w1", fns.coded_calls_received) - before == 2

    on_a_thread(on_a_thread_of_its_own)


def test_autograd_a_chain_through_the_root_goes_hop_by_hop_on_its_lanes(
    group: Group, layers: Callable
) -> None:
    # driver -> w3 -> driver -> w1 -> driver: each pass on the driver sends one hop, so
    # its thread sends each on its lane (w3's, then w1's) and runs the gradients the
    # replies bring back itself, hop after hop; the loop never takes part.
    def on_a_thread_of_its_own() -> tuple[list[int], int]:
        l1, l3 = layers("w1", 71, 4, 6), layers("w3", 72, 6, 2)
        for worker in ("w1", "w3", "w1", "w3"):  # the second call to each opens a lane
            asyncrpc.rpc_sync(worker, fns.num_contexts)
        before = [asyncrpc.rpc_sync(w, fns.coded_calls_received) for w in ("w1", "w3")]
        on_lane = asyncrpc.get_debug_info()["autograd_root_hops_on_lane"]
        x = torch.randn(3, 4, requires_grad=True)
        with dist_autograd.context() as context_id:
            h = asyncrpc.rpc_sync("w1", fns.forward, args=(l1, x))
            y = asyncrpc.rpc_sync("w3", fns.forward, args=(l3, torch.relu(h)))
            dist_autograd.backward(context_id, [y.pow(2).sum()])
            m1, m3 = fns.make_linear(71, 4, 6), fns.make_linear(72, 6, 2)
            x_local = x.detach().clone().requires_grad_()
            m3(torch.relu(m1(x_local))).pow(2).sum().backward()
            assert_grads_match(context_id, [("w1", l1), ("w3", l3)], [m1, m3])
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x_local.grad)
        after = [asyncrpc.rpc_sync(w, fns.coded_calls_received) for w in ("w1", "w3")]
        hops = asyncrpc.get_debug_info()["autograd_root_hops_on_lane"] - on_lane
        return [a - b for a, b in zip(after, before, strict=True)], hops

    assert on_a_thread(on_a_thread_of_its_own) == ([1, 1], 2)


def test_autograd_error_in_a_hop_the_root_thread_runs_reaches_backward(group: Group) -> None:
    x = torch.randn(3, requires_grad=True)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise KeyError("hook of the root's own tensor")

    x.register_hook(fail)
    with dist_autograd.context() as context_id:
        back = asyncrpc.rpc_sync("w1", fns.echo, args=(x * 2,))
        with pytest.raises(KeyError) as raised:
            dist_autograd.backward(context_id, [back.sum()])
        assert isinstance(raised.value, BackwardError)
        assert raised.value.node == 0
        # The context stays usable: a pass that does not reach the hook works.
        y = torch.randn(3, requires_grad=True)
        dist_autograd.backward(context_id, [asyncrpc.rpc_sync("w1", fns.echo, args=(y,)).sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[y], torch.ones(3))


def test_autograd_retain_graph_two_backwards_accumulate(group: Group, layers: Callable) -> None:
    layer = layers("w1", 6, 3, 3)
    x = torch.randn(2, 3)
    with dist_autograd.context() as context_id:
        loss = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x)).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        local = fns.make_linear(6, 3, 3)
        (local(x).sum() * 2).backward()
        assert_grads_match(context_id, [("w1", layer)], [local])
        with pytest.raises(RuntimeError, match="second time"):
            dist_autograd.backward(context_id, [loss])  # that graph was not retained


def test_autograd_concurrent_trainers_never_mix_gradients(group: Group, layers: Callable) -> None:
    layer = layers("w2", 7, 4, 2)
    inputs = [torch.randn(3, 4) for _ in range(4)]
    results: dict[int, list[torch.Tensor | None]] = {}
    errors: list[BaseException] = []

    def trainer(index: int) -> None:
        try:
            with dist_autograd.context() as context_id:
                for _ in range(3):  # several steps interleave with the other trainers
                    y = asyncrpc.rpc_sync("w2", fns.forward, args=(layer, inputs[index]))
                    dist_autograd.backward(context_id, [(y * (index + 1)).sum()])
                results[index] = asyncrpc.rpc_sync("w2", fns.grads_of, args=(context_id, layer))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    for index, grads in results.items():
        local = fns.make_linear(7, 4, 2)
        for _ in range(3):
            (local(inputs[index]) * (index + 1)).sum().backward()
        for grad, param in zip(grads, local.parameters(), strict=True):
            torch.testing.assert_close(grad, param.grad)


def test_autograd_async_context_and_backward(group: Group, layers: Callable) -> None:
    layer = layers("w3", 8, 2, 2)
    x = torch.randn(2, 2)

    async def step() -> list[torch.Tensor | None]:
        async with dist_autograd.context() as context_id:
            y = await asyncrpc.call("w3", fns.forward, layer, x)
            await dist_autograd.backward_async(context_id, [y.sum()])
            return await asyncrpc.call("w3", fns.grads_of, context_id, layer)

    grads = asyncio.run(step())
    local = fns.make_linear(8, 2, 2)
    local(x).sum().backward()
    for grad, param in zip(grads, local.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad)


def test_autograd_remote_and_to_here(group: Group, layers: Callable) -> None:
    layer = layers("w1", 9, 3, 3)
    x = torch.randn(2, 3)
    with dist_autograd.context() as context_id:
        out = asyncrpc.remote("w1", fns.forward, args=(layer, x))  # the value stays on w1
        dist_autograd.backward(context_id, [out.to_here().sum()])
        local = fns.make_linear(9, 3, 3)
        local(x).sum().backward()
        assert_grads_match(context_id, [("w1", layer)], [local])
        del out


def test_autograd_error_in_remote_backward_keeps_its_type(group: Group) -> None:
    a = torch.randn(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w3", fns.fail_in_backward, args=(a,))
        with pytest.raises(KeyError, match="broken backward") as info:
            dist_autograd.backward(context_id, [y.sum()])
        assert info.value.remote_worker == "w3"  # type: ignore[attr-defined]
        # ... and as torch reports it: a RuntimeError naming the node that failed.
        assert isinstance(info.value, BackwardError)
        assert isinstance(info.value, RuntimeError)
        assert str(info.value) == "Error on Node 3: 'broken backward'"


def test_autograd_error_in_a_hop_on_the_lane_keeps_its_type(group: Group) -> None:
    # The hop to w3 goes on this thread's lane (opened by the calls before it): the
    # error comes back in the lane's reply, as it does in the loop's.
    def on_a_thread_of_its_own() -> tuple[BaseException, int]:
        for _ in range(2):
            asyncrpc.rpc_sync("w3", fns.num_contexts)
        before = asyncrpc.get_debug_info()["autograd_root_hops_on_lane"]
        a = torch.randn(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w3", fns.fail_in_backward, args=(a,))
            with pytest.raises(KeyError, match="broken backward") as info:
                dist_autograd.backward(context_id, [y.sum()])
        return info.value, asyncrpc.get_debug_info()["autograd_root_hops_on_lane"] - before

    out: list[tuple[BaseException, int]] = []
    thread = threading.Thread(target=lambda: out.append(on_a_thread_of_its_own()))
    thread.start()
    thread.join(60)
    ((error, on_lane),) = out
    assert on_lane == 1
    assert isinstance(error, BackwardError)
    assert isinstance(error, RuntimeError)
    assert error.remote_worker == "w3"  # type: ignore[attr-defined]
    assert str(error) == "Error on Node 3: 'broken backward'"


def test_autograd_unknown_context_and_blocking_misuse(group: Group) -> None:
    with pytest.raises(AutogradContextError):
        dist_autograd.get_gradients(12345)
    with pytest.raises(AutogradContextError):
        dist_autograd.backward(12345, [torch.ones(1, requires_grad=True).sum()])
    assert dist_autograd.current_context() is None
    with dist_autograd.context() as context_id:
        assert dist_autograd.current_context() == context_id
    assert dist_autograd.current_context() is None


def test_autograd_field_only_inside_a_context(group: Group) -> None:
    agent = current_agent()
    tensor = torch.ones(2, requires_grad=True)

    def request_fields(fn: Any = fns.echo, *args: Any) -> list[Any]:
        args = args or (tensor,)
        encoded = agent.outbox.encode(1, fn, args, {}, 5.0, CallKind.SYNC)
        if encoded.observed is not None:  # never sent: tell the hooks it ended
            Pipeline.completed(*encoded.observed, None, None)
        decoder = FrameDecoder()
        return next(f for piece in encoded.pieces for f in decoder.feed(piece)).fields

    assert len(request_fields()) == 7  # no pipeline field outside a context
    with dist_autograd.context() as context_id:
        fields = request_fields()
        assert fields[7]["ag"][0] == context_id
        # torch's rule: a builtin op sending no tensor requiring grad records nothing.
        assert len(request_fields(torch.add, torch.ones(2), 1)) == 7
        assert request_fields(torch.add, tensor, 1)[7]["ag"][0] == context_id
    assert len(request_fields()) == 7


@pytest.mark.parametrize("lane", [False, True], ids=["loop", "lane"])
def test_autograd_worker_killed_during_backward(tmp_path: Path, lane: bool) -> None:
    """In a group of its own: the victim dies inside its part of the backward pass (the
    hop to it sent the loop's way, or on the lane of the thread in backward())."""
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(f"k{r}", r, 3, init, log_dir=tmp_path, rpc_timeout=20.0) for r in (1, 2)
    ]
    try:
        flags = [] if lane else ["--no-lanes"]
        driver = scenarios.start("autograd_killed_in_backward", "--init-method", init, *flags)
        try:
            code, outcome = driver.result(60.0)
        finally:
            driver.kill()
        assert code == 0, driver.text()
        assert outcome["error"] == "PeerLostError"
        # Found by the lost connection, not by a timeout (rpc_timeout is 20 s).
        assert outcome["seconds"] < 10
        assert outcome["contexts_left"] == {"k0": 0, "k1": 0}
        assert outcome["hops_on_lane"] == int(lane)
    finally:
        stop_workers(workers, timeout=5)


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
    for worker in ("w1", "w3", "w1", "w3"):  # the second call to each opens a lane
        asyncrpc.rpc_sync(worker, fns.num_contexts)
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


@pytest.mark.parametrize("fetcher", ["w3", "w2"])  # a thread-pool worker, an asyncio one
def test_rref_proxy_method_runs_in_the_callers_context(group: Group, fetcher: str) -> None:
    """A plain method called through a proxy runs on the owner's pool, inside the caller's
    context: an RRef it fetches is recorded, so the gradient reaches that RRef's owner
    (torch's pipeline-parallel tutorial). It used to lose the context: no gradient, no error."""
    scale = asyncrpc.remote("w1", fns.Scale)
    fetch = asyncrpc.remote(fetcher, fns.FetchTwice)
    scale.rpc_sync().extra_repr()  # the proxies know the types before the context, as torch's
    fetch.rpc_sync().extra_repr()
    with dist_autograd.context() as context_id:
        y = scale.remote().forward(torch.arange(3.0))
        z = fetch.rpc_sync().forward(y)
        dist_autograd.backward(context_id, [z.sum()])
        grads = asyncrpc.rpc_sync("w1", fns.grads_of, args=(context_id, scale))
    assert len(grads) == 1
    assert grads[0] is not None
    torch.testing.assert_close(grads[0], torch.tensor([0.0, 2.0, 4.0]))
    del y, scale, fetch


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


def test_autograd_through_an_async_execution_coroutine(group: Group) -> None:
    a = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", fns.scaled_by_peer, args=("w3", a))  # w1 -> w3 nested
        dist_autograd.backward(context_id, [y.sum()])
        grad = dist_autograd.get_gradients(context_id)[a]
    a_local = a.detach().clone().requires_grad_()
    (fns.product(a_local, a_local) * 2).sum().backward()
    torch.testing.assert_close(grad, a_local.grad)


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
