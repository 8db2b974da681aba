"""``LocalGraph.run_on_loop``: a small pass of built-in nodes runs on the calling thread;
any Python code in the graph (a hook, a custom Function) stops it before that code runs."""

from __future__ import annotations

import cProfile
import gc
import sys
from typing import Any

import pytest
import torch
from torch import nn

from asyncrpc.autograd import graph
from asyncrpc.autograd.graph import LocalGraph


def _layer_output() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    return layer, x, torch.relu(layer(x))


def test_a_small_plain_pass_gives_torchs_gradients() -> None:
    layer, x, y = _layer_output()
    seed = torch.randn_like(y)
    routed = LocalGraph().run_on_loop([y], [seed])
    assert routed is not None
    got = {id(leaf): grad for leaf, grad in routed}
    want = torch.autograd.grad([y], [x, layer.weight, layer.bias], [seed], retain_graph=True)
    assert set(got) == {id(x), id(layer.weight), id(layer.bias)}
    for leaf, grad in zip((x, layer.weight, layer.bias), want, strict=True):
        torch.testing.assert_close(got[id(leaf)], grad)
    assert layer.weight.grad is None  # gradients are returned, never accumulated
    assert sys.getprofile() is None  # the guard is gone again
    assert gc.isenabled()


def test_the_graph_is_kept_for_another_pass() -> None:
    _, _, y = _layer_output()
    first = LocalGraph().run_on_loop([y], [torch.ones_like(y)])
    second = LocalGraph().run_on_loop([y], [torch.ones_like(y)])
    assert first is not None
    assert second is not None
    for (_, a), (_, b) in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


def test_a_tensor_hook_stops_the_pass_before_it_runs() -> None:
    calls: list[Any] = []
    layer, x, _ = _layer_output()
    h = layer(x)
    # A Python function (a builtin such as calls.append enters no Python frame: unseen).
    h.register_hook(lambda grad: calls.append(grad))  # noqa: PLW0108
    y = torch.relu(h)
    assert LocalGraph().run_on_loop([y], [torch.ones_like(y)]) is None
    assert calls == []
    assert sys.getprofile() is None
    assert gc.isenabled()


def test_a_leaf_hook_and_a_custom_function_stop_it_too() -> None:
    calls: list[str] = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            return a * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            calls.append("backward")
            return grad * 2

    layer, x, _ = _layer_output()
    y = Double.apply(layer(x))
    assert LocalGraph().run_on_loop([y], [torch.ones_like(y)]) is None
    leaf = torch.randn(3, requires_grad=True)
    leaf.register_hook(lambda grad: calls.append("hook"))
    z = leaf * 3
    assert LocalGraph().run_on_loop([z], [torch.ones_like(z)]) is None
    assert calls == []


def _no_entry(tensor: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a leaf without hooks needs no entry node")


def test_a_leaf_root_without_hooks_is_routed_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing of the graph runs for it: its gradient is the one given, not even copied.
    monkeypatch.setattr(graph, "_enter", _no_entry)
    leaf = torch.randn(4, requires_grad=True)
    seed = torch.full((4,), 2.0)
    on_loop = LocalGraph().run_on_loop([leaf], [seed])
    on_thread, on_torch_engine = LocalGraph().run([leaf], [seed], dict, 0)
    for routed in (on_loop, on_thread):
        assert routed is not None
        assert len(routed) == 1
        assert routed[0][0] is leaf
        assert routed[0][1] is seed
    assert not on_torch_engine


def test_a_leaf_root_with_a_hook_or_a_parameter_enters_the_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Through this module's entry node, so the leaf's hooks see (and may change) the gradient.
    seen: list[torch.Tensor] = []
    leaf = torch.randn(4, requires_grad=True)
    leaf.register_hook(lambda grad: seen.append(grad) or grad * 3)
    routed, _ = LocalGraph().run([leaf], [torch.full((4,), 2.0)], dict, 0)
    assert len(seen) == 1
    torch.testing.assert_close(routed[0][1], torch.full((4,), 6.0))
    param = nn.Parameter(torch.randn(2))
    entered: list[torch.Tensor] = []
    original = graph._enter

    def spy(tensor: torch.Tensor) -> torch.Tensor:
        entered.append(tensor)
        return original(tensor)

    monkeypatch.setattr(graph, "_enter", spy)
    routed = LocalGraph().run_on_loop([param], [torch.ones(2)])
    assert len(entered) == 1
    assert entered[0] is param
    assert routed is not None
    assert routed[0][0] is param


def test_big_graphs_and_a_running_profiler_go_to_the_pool() -> None:
    wide = torch.randn(graph.LOOP_PASS_MAX_ELEMENTS + 1, requires_grad=True)
    big = wide * 2
    assert LocalGraph().run_on_loop([big], [torch.ones_like(big)]) is None
    deep = torch.randn(2, requires_grad=True)
    for _ in range(graph.LOOP_PASS_MAX_NODES + 1):
        deep = deep + 1
    assert LocalGraph().run_on_loop([deep], [torch.ones_like(deep)]) is None
    _, _, y = _layer_output()
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        assert LocalGraph().run_on_loop([y], [torch.ones_like(y)]) is None
    finally:
        profiler.disable()


def test_an_error_in_a_builtin_node_is_raised_as_torch_reports_it() -> None:
    _, _, y = _layer_output()
    with pytest.raises(RuntimeError, match="shape"):
        LocalGraph().run_on_loop([y], [torch.ones(5)])
    assert sys.getprofile() is None
    assert gc.isenabled()
