"""Distributed autograd on lanes, with real worker processes over 127.0.0.1: the thread
in ``backward()`` sends its hops on its own lanes and reads their replies itself, a hop
travels in its own format, and a hop whose pass sends nothing on replies before it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.errors import BackwardError
from tests.integration import autograd_fns as fns
from tests.integration.autograd_support import assert_grads_match, on_a_thread, open_lanes
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(90)


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
        open_lanes("w1")
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
        open_lanes("w1")
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
        open_lanes("w1", "w3")
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


def test_autograd_error_in_a_hop_on_the_lane_keeps_its_type(group: Group) -> None:
    # The hop to w3 goes on this thread's lane (opened by the calls before it): the
    # error comes back in the lane's reply, as it does in the loop's.
    def on_a_thread_of_its_own() -> tuple[BaseException, int]:
        open_lanes("w3")
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


def test_autograd_a_hop_that_sends_nothing_on_replies_before_its_pass(
    group: Group, layers: Callable
) -> None:
    # The training step of the bench: x needs no gradient, so w1's pass sends nothing
    # back. w1 replies to the hop at once and runs the pass after (its lane thread);
    # whatever reads the context's gradients there waits for it: this thread's next call
    # (same lane), and another thread's at once.
    def on_a_thread_of_its_own() -> int:
        layer = layers("w1", 81, 8, 4)
        open_lanes("w1")
        before = asyncrpc.rpc_sync("w1", fns.hops_replied_first)
        m1 = fns.make_linear(81, 8, 4)
        for step in range(3):
            x = torch.randn(16, 8)
            with dist_autograd.context() as context_id:
                y = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x))
                dist_autograd.backward(context_id, [y.pow(2).sum()])
                m1.zero_grad()
                m1(x).pow(2).sum().backward()
                if step == 1:  # read at once from another thread: its own lane or the loop
                    other = threading.Thread(
                        target=assert_grads_match, args=(context_id, [("w1", layer)], [m1])
                    )
                    other.start()
                    other.join(30)
                    assert not other.is_alive()
                assert_grads_match(context_id, [("w1", layer)], [m1])
        return int(asyncrpc.rpc_sync("w1", fns.hops_replied_first) - before)

    assert on_a_thread(on_a_thread_of_its_own) == 3


def test_autograd_a_hop_whose_pass_sends_on_replies_after_it(
    group: Group, layers: Callable
) -> None:
    # x requires grad: w1's pass gives x's gradient, which its reply carries. That hop
    # cannot reply first.
    def on_a_thread_of_its_own() -> int:
        layer = layers("w1", 82, 8, 4)
        open_lanes("w1")
        before = asyncrpc.rpc_sync("w1", fns.hops_replied_first)
        x = torch.randn(16, 8, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", fns.forward, args=(layer, x))
            dist_autograd.backward(context_id, [y.pow(2).sum()])
            x_local = x.detach().clone().requires_grad_()
            fns.make_linear(82, 8, 4)(x_local).pow(2).sum().backward()
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x_local.grad)
        return int(asyncrpc.rpc_sync("w1", fns.hops_replied_first) - before)

    assert on_a_thread(on_a_thread_of_its_own) == 0


def test_autograd_a_late_pass_that_fails_fails_the_readers_of_its_context(
    group: Group, layers: Callable
) -> None:
    # A hook on an inner tensor of w1's forward raises in the backward. The walk cannot
    # see it, so the hop replied first and backward() returned; the error is not lost:
    # every reader of the context's gradients on w1 gets it, with its type (the
    # optimizer's step would too). A documented limit (docs/autograd.md).
    def on_a_thread_of_its_own() -> None:
        layer = layers("w1", 83, 8, 4)
        open_lanes("w1")
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync(
                "w1", fns.forward_inner_hook_fails, args=(layer, torch.ones(2, 8))
            )
            dist_autograd.backward(context_id, [y.sum()])
            for _ in range(2):
                with pytest.raises(KeyError, match="hook of an inner tensor") as raised:
                    asyncrpc.rpc_sync("w1", fns.grads_of, args=(context_id, layer))
                assert isinstance(raised.value, BackwardError)

    on_a_thread(on_a_thread_of_its_own)
