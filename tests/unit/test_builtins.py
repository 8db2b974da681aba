"""Unit tests of asyncrpc.runtime.calls.builtins: which builtin op calls run on the event loop."""

from __future__ import annotations

import torch

from asyncrpc.runtime.calls.builtins import SMALL_OP_NUMEL, runs_on_loop


def test_runs_on_loop_small_elementwise_ops_and_reductions() -> None:
    a, b = torch.ones(3, 4), torch.ones(4)
    assert runs_on_loop(torch.add, (a, b), {"alpha": 2})
    assert runs_on_loop(torch.mul, (a, 3.0), {})
    assert runs_on_loop(torch.sum, (a,), {})
    assert runs_on_loop(torch.relu, (torch.ones(SMALL_OP_NUMEL),), {})
    assert runs_on_loop(torch.add, (torch.ones(3), torch.ones(4)), {})  # fails at once anyway


def test_runs_on_loop_refuses_unbounded_or_unknown_work() -> None:
    small = torch.ones(4)
    assert not runs_on_loop(torch.add, (torch.ones(SMALL_OP_NUMEL + 1), 1), {})
    # Two small inputs whose broadcast is large.
    assert not runs_on_loop(torch.add, (torch.ones(1000, 1), torch.ones(1, 1000)), {})
    assert not runs_on_loop(torch.ones, (10**9,), {})  # sizes, not tensors: not in the list
    assert not runs_on_loop(torch.mm, (torch.ones(2, 2), torch.ones(2, 2)), {})
    assert not runs_on_loop(torch.add, (small, small), {"out": torch.empty(4)})
    assert not runs_on_loop(torch.add, (small, [1, 2, 3, 4]), {})  # not a plain number
    assert not runs_on_loop(torch.add, (torch.nn.Parameter(small), small), {})
    assert not runs_on_loop(torch.add, (small.to_sparse(), small), {})
    assert not runs_on_loop(lambda x: x, (small,), {})
    assert not runs_on_loop(print, (small,), {})  # a builtin, not a listed op
