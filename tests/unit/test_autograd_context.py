"""Gradients a hop's pass holds back until its reply is written (AutogradContext.defer):
added by settle(), or by whatever reads or adds gradients first, in the same order."""

from __future__ import annotations

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
