"""Gradients a hop's pass holds back until its reply is written (AutogradContext.defer):
added by settle(), or by whatever reads or adds gradients first, in the same order."""

from __future__ import annotations

import torch

from asyncrpc.autograd.context import AutogradContext


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
