"""Distributed autograd with real worker processes over 127.0.0.1: gradients equal
single-process autograd, contexts are released everywhere, failures reach the caller.

The driver (this process) runs forward and backward; w1 and w3 serve on thread pools, w2
on its event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.errors import AutogradContextError, BackwardError
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.runtime.calls.pipeline import CallKind, Pipeline
from asyncrpc.runtime.current import current_agent
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.integration import autograd_fns as fns
from tests.integration.autograd_support import (
    assert_grads_match,
    contexts_everywhere,
    contexts_settle_at,
)
from tests.integration.conftest import WORLD, Group
from tests.ordering import until

pytestmark = pytest.mark.timeout(90)


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


def test_autograd_through_an_async_execution_coroutine(group: Group) -> None:
    a = torch.randn(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", fns.scaled_by_peer, args=("w3", a))  # w1 -> w3 nested
        dist_autograd.backward(context_id, [y.sum()])
        grad = dist_autograd.get_gradients(context_id)[a]
    a_local = a.detach().clone().requires_grad_()
    (fns.product(a_local, a_local) * 2).sum().backward()
    torch.testing.assert_close(grad, a_local.grad)
