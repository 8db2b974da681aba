"""torch's rules of distributed autograd that programs written for torch rely on, checked
with real worker processes over 127.0.0.1: errors as torch reports them, contexts that do
not nest, hooks on sent tensors, gradients kept without a copy, and ``RRef.backward``.
"""

from __future__ import annotations

import traceback
from typing import Any, ClassVar

import pytest
import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.errors import AutogradContextError, BackwardError, RRefError
from tests.integration import autograd_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(90)


def test_autograd_error_relayed_over_many_hops_names_its_node_and_stays_small(
    group: Group,
) -> None:
    a = torch.randn(3, 3, requires_grad=True)
    hops = [("w1", torch.add), ("w2", torch.mul), ("w3", torch.add), ("w1", torch.mul)]
    with dist_autograd.context() as context_id:
        val = fns.fail_in_backward(a)  # fails here, where the pass ends after every hop
        for worker, op in hops:
            val = asyncrpc.rpc_sync(worker, op, args=(val, a))
        with pytest.raises(RuntimeError, match=r"^Error on Node 0: 'broken backward'") as info:
            dist_autograd.backward(context_id, [val.sum()])
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, BackwardError)
    assert info.value.node == 0
    # One traceback per hop: the record of an error relayed over n hops used to double
    # with each (hundreds of kB after five).
    assert len("".join(traceback.format_exception(info.value))) < 40_000


def test_autograd_contexts_do_not_nest(group: Group) -> None:
    with dist_autograd.context() as context_id:
        with (
            pytest.raises(AutogradContextError, match=r"^Already have an autograd context id"),
            dist_autograd.context(),
        ):
            pass
        assert dist_autograd.current_context() == context_id  # the outer one is untouched
        # A function run by an RPC made in a context runs in that context too.
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            asyncrpc.rpc_sync("w1", fns.open_context)
    assert asyncrpc.rpc_sync("w1", fns.open_context) != context_id  # outside: its own


def test_autograd_hooks_of_sent_tensors_see_their_gradients(group: Group) -> None:
    seen: list[torch.Tensor] = []
    a = torch.ones(3, 3, requires_grad=True)  # a leaf, sent
    a.register_hook(lambda grad: grad * 2)
    b = torch.ones(3, 3, requires_grad=True)
    h = b * 3  # not a leaf, sent
    h.register_hook(lambda grad: seen.append(grad) or grad * 10)
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", torch.matmul, args=(a, h))
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    a_local, b_local = (t.detach().clone().requires_grad_() for t in (a, b))
    a_local.register_hook(lambda grad: grad * 2)
    h_local = b_local * 3
    h_local.register_hook(lambda grad: grad * 10)
    torch.matmul(a_local, h_local).sum().backward()
    torch.testing.assert_close(grads[a], a_local.grad)
    torch.testing.assert_close(grads[b], b_local.grad)
    assert len(seen) == 1


class _Recorded(torch.autograd.Function):
    """Identity; its backward records where the gradient it hands on lives."""

    pointer: ClassVar[int] = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Recorded.pointer = grad.data_ptr()
        return grad


class _Twice(torch.autograd.Function):
    """x + y; its backward hands one gradient tensor to both inputs."""

    pointer: ClassVar[int] = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _Twice.pointer = grad.data_ptr()
        return grad, grad


class _Expanded(torch.autograd.Function):
    """To one element; its backward hands on an expanded (strided) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.sum().reshape(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape)


def test_autograd_gradient_kept_without_a_copy_where_its_layout_allows(group: Group) -> None:
    a = torch.randn(5, 6, requires_grad=True)
    b = torch.randn(5, 6, requires_grad=True)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_Recorded.apply(a)[1][0]])
        kept = dist_autograd.get_gradients(context_id)[a]
        assert kept.data_ptr() == _Recorded.pointer  # handed over, not copied
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_Twice.apply(a, b)[1][0]])
        grads = dist_autograd.get_gradients(context_id)
        pointers = {grads[a].data_ptr(), grads[b].data_ptr(), _Twice.pointer}
        assert len(pointers) == 3  # one tensor for two leaves: each got a copy
        torch.testing.assert_close(grads[a], grads[b])
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_Expanded.apply(a)])
        grad = dist_autograd.get_gradients(context_id)[a]
        assert grad.is_contiguous()  # copied into the leaf's layout
        torch.testing.assert_close(grad, torch.ones(5, 6))
        dist_autograd.backward(context_id, [_Expanded.apply(a)])  # accumulates out of place
        torch.testing.assert_close(grad, torch.ones(5, 6))
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], torch.ones(5, 6) * 2)


def test_rref_backward_on_the_owner_local_or_in_a_context(group: Group) -> None:
    t = torch.rand(4, requires_grad=True)
    asyncrpc.RRef(t.sum() * 2).backward()  # no context: local autograd, into .grad
    torch.testing.assert_close(t.grad, torch.full((4,), 2.0))
    with dist_autograd.context() as context_id:
        y = asyncrpc.rpc_sync("w1", torch.mul, args=(t, 3))
        rref = asyncrpc.RRef(y.sum())
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t], torch.full((4,), 6.0)
        )
        with pytest.raises(AutogradContextError, match="Could not find autograd context"):
            asyncrpc.RRef(y.sum()).backward(12345)
    torch.testing.assert_close(t.grad, torch.full((4,), 2.0))  # left alone by the context
    with pytest.raises(RRefError, match=r"^RRef should contain a tensor for \.backward\(\)"):
        asyncrpc.RRef("foo").backward()
    with pytest.raises(RuntimeError, match="does not require grad"):
        asyncrpc.RRef(torch.rand(3).sum()).backward()


def test_rref_backward_of_a_user_runs_on_the_owner(group: Group) -> None:
    t = torch.rand(10, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref = asyncrpc.remote("w2", fns.total, args=(t,))  # w2 serves on its loop
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(
            dist_autograd.get_gradients(context_id)[t], torch.full((10,), 2.0)
        )
        with pytest.raises(RuntimeError, match="second time"):
            rref.backward(context_id)  # that graph was not retained
        with pytest.raises(RRefError, match="require 'dist_autograd_ctx_id' to be specified"):
            rref.backward()
        not_a_tensor = asyncrpc.remote("w3", fns.echo, args=("foo",))
        with pytest.raises(RRefError, match="should contain a tensor"):
            not_a_tensor.backward(context_id)
        del rref, not_a_tensor
    assert t.grad is None
