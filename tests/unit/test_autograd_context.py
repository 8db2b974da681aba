"""Gradients a hop's pass holds back until its reply is written (AutogradContext.defer),
and whole passes run after it (run_late): added by settle(), or by whatever reads or adds
gradients first, in the same order."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrpc.autograd.context import AutogradContext
from asyncrpc.autograd.graph import Plan, plan_holds


def test_deferred_gradients_are_added_when_the_context_settles() -> None:
    context = AutogradContext(1)
    weight = torch.zeros(3)
    grad = torch.ones(3)
    context.defer([(weight, grad, False)])
    assert context.grads == {}  # held back: the reply goes first
    context.settle()
    assert context.grads[weight] is grad  # kept without a copy, as accumulate keeps it
    context.settle()  # nothing left: no second sum
    assert torch.equal(context.grads[weight], grad)


def test_a_reader_before_settle_sees_the_deferred_gradients() -> None:
    context = AutogradContext(2)
    weight = torch.zeros(2)
    context.defer([(weight, torch.full((2,), 2.0), False)])
    assert torch.equal(context.gradients()[weight], torch.full((2,), 2.0))
    context.settle()  # already added by the reader
    assert torch.equal(context.gradients()[weight], torch.full((2,), 2.0))


def test_an_accumulate_after_a_defer_adds_in_the_order_of_the_calls() -> None:
    # (a + b) + c and (a + c) + b may round differently: the held-back terms go first.
    context = AutogradContext(3)
    weight = torch.zeros(1, dtype=torch.float32)
    a, b, c = (torch.tensor([x], dtype=torch.float32) for x in (1e8, 1.0, -1e8))
    context.defer([(weight, a, False), (weight, b, False)])
    context.accumulate(weight, c)
    assert torch.equal(context.gradients()[weight], (a + b) + c)


def test_a_shared_deferred_gradient_is_copied() -> None:
    context = AutogradContext(4)
    w1, w2 = torch.zeros(2), torch.zeros(2)
    grad = torch.ones(2)
    context.defer([(w1, grad, True), (w2, grad, True)])
    grads = context.gradients()
    assert grads[w1] is not grad
    assert grads[w2] is not grad
    assert grads[w1] is not grads[w2]


def _sent_layer() -> tuple[AutogradContext, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A context that sent ``y = layer(x)`` in message 7 (x received, a leaf)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    context = AutogradContext(5)
    context.record_recv(1, 3, [x])
    context.record_send(7, 1, [y])
    return context, layer, x, y


def _pass(context: AutogradContext, y: torch.Tensor, planned: Plan | None) -> dict[int, object]:
    routed, _ = context.graph.run([y], [torch.ones(2, 3)], context.received, 0, planned)
    return {id(leaf): grad for leaf, grad in routed}


def test_a_pass_planned_ahead_gives_the_gradients_of_one_planned_as_it_runs() -> None:
    context, layer, x, y = _sent_layer()
    context.plan_sent(7)
    planned = context.planned(7)
    assert planned is not None
    assert plan_holds(planned, [y])
    assert sorted(map(id, planned.walk[0])) == sorted(map(id, [x, layer.weight, layer.bias]))
    with_plan = _pass(context, y, planned)
    without = _pass(context, y, None)
    assert with_plan.keys() == without.keys() == {id(x), id(layer.weight), id(layer.bias)}
    for key, grad in with_plan.items():
        assert torch.equal(grad, without[key])  # type: ignore[arg-type]


def test_a_root_changed_in_place_after_planning_makes_the_plan_stale() -> None:
    context, _, _, y = _sent_layer()
    context.plan_sent(7)
    planned = context.planned(7)
    assert planned is not None
    extra = torch.randn(2, 3, requires_grad=True)
    y.add_(extra)  # y gets another node, reaching a leaf the plan never saw
    assert not plan_holds(planned, [y])


def test_only_tensors_with_a_graph_are_planned() -> None:
    context = AutogradContext(6)
    leaf = torch.randn(3, requires_grad=True)
    context.record_send(9, 1, [leaf])  # a leaf sent as it is: its pass needs no plan
    context.plan_sent(9)
    context.plan_sent(10)  # no such message
    assert context.planned(9) is None
    assert context.planned(10) is None


def test_a_pass_run_late_goes_before_the_gradients_deferred_after_it() -> None:
    # A hop that replied first (its pass left to run_late), then a hop whose gradients
    # were deferred: whoever settles adds the late pass's terms first, as the hops came.
    context = AutogradContext(6)
    weight = torch.zeros(1, dtype=torch.float32)
    a, b = torch.tensor([1e8]), torch.tensor([1.0])
    ran: list[str] = []

    def late() -> None:
        ran.append("late")
        context.accumulate(weight, a)  # a late pass adds its own gradients (re-entrant)

    context.run_late(late)
    context.defer([(weight, b, False)])
    assert context.grads == {}  # nothing ran yet
    assert torch.equal(context.gradients()[weight], a + b)
    context.settle()  # already run by the reader: not twice
    assert ran == ["late"]


def test_a_reader_on_another_thread_waits_for_a_late_pass_running() -> None:
    context = AutogradContext(7)
    weight = torch.zeros(2)
    started, release = threading.Event(), threading.Event()

    def late() -> None:
        started.set()
        assert release.wait(5)
        context.accumulate(weight, torch.ones(2))

    context.run_late(late)
    runner = threading.Thread(target=context.settle)
    runner.start()
    assert started.wait(5)
    seen: list[dict[object, torch.Tensor]] = []
    reader = threading.Thread(target=lambda: seen.append(context.gradients()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # it waits for the pass, never reads half of it
    release.set()
    runner.join(5)
    reader.join(5)
    assert torch.equal(seen[0][weight], torch.ones(2))


def test_a_late_pass_that_failed_fails_every_reader() -> None:
    context = AutogradContext(8)

    def late() -> None:
        raise KeyError("a hook on an inner tensor")

    context.run_late(late)

    def add() -> None:
        context.accumulate(torch.zeros(1), torch.ones(1))

    for read in (context.settle, context.gradients, add):
        with pytest.raises(KeyError, match="inner tensor"):
            read()
