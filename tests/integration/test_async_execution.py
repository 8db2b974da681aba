"""``@async_execution`` functions that return ``then`` chains, torch's futures and ours,
across real processes; and their failures reach the caller instead of hanging it."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

import asyncrpc
from tests.integration import async_exec_fns as af
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)

# Bounds a call that would otherwise hang (it never should): the test fails, not stalls.
BOUND = 20.0


def _tag() -> str:
    return uuid.uuid4().hex


@pytest.mark.parametrize(
    ("chain", "complete"),
    [
        (af.torch_then, af.complete_torch),
        (af.torch_then_ours, af.complete_torch),
        (af.ours_then, af.complete_ours),
    ],
    ids=["torch_future_torch_decorator", "torch_future_our_decorator", "our_future"],
)
@pytest.mark.parametrize("to", ["w1", "w2"])  # w2 runs on init_rpc_async
def test_async_execution_then_chain_completed_by_a_later_call(
    group: Group, chain: Callable[[str], object], complete: Callable[[str, int], None], to: str
) -> None:
    tag = _tag()
    pending = asyncrpc.rpc_async(to, chain, args=(tag,), timeout=BOUND)
    asyncrpc.rpc_sync(to, complete, args=(tag, 4), timeout=BOUND)
    assert pending.wait() == (4 + 1) * 2


def test_async_execution_then_chain_as_a_remote_value(group: Group) -> None:
    tag = _tag()
    rref = asyncrpc.remote("w3", af.torch_then, args=(tag,), timeout=BOUND)
    asyncrpc.rpc_sync("w3", af.complete_torch, args=(tag, 1), timeout=BOUND)
    assert rref.to_here(BOUND) == 4


def test_async_execution_then_chain_through_an_rref_proxy(group: Group) -> None:
    rref = asyncrpc.remote("w1", af.Batcher, args=(1,))
    assert rref.rpc_sync(timeout=BOUND).plus_one_later(41) == 42


def test_async_execution_batch_agent_answers_every_caller(group: Group) -> None:
    """The pattern of pytorch/examples distributed/rpc/batch/reinforce.py."""
    size = 4
    batcher = asyncrpc.remote("w1", af.Batcher, args=(size,))
    for _ in range(3):  # each round completes one batch and starts the next
        futs = [
            asyncrpc.rpc_async("w1", af.Batcher.select, args=(batcher, i, float(i)), timeout=BOUND)
            for i in range(size)
        ]
        assert [f.wait() for f in futs] == [0.0, 10.0, 20.0, 30.0]


def test_async_execution_then_callback_error_reaches_the_caller(group: Group) -> None:
    tag = _tag()
    pending = asyncrpc.rpc_async("w1", af.torch_then_raises, args=(tag,), timeout=BOUND)
    asyncrpc.rpc_sync("w1", af.complete_torch, args=(tag, 7), timeout=BOUND)
    with pytest.raises(RuntimeError, match="KeyError: 'after 7'"):  # torch's words for it
        pending.wait()


_NO_FUTURE: dict[str, Callable[[], object]] = {
    "rpc_sync": lambda: asyncrpc.rpc_sync("w2", af.returns_no_future, args=(3,), timeout=BOUND),
    "remote": lambda: asyncrpc.remote("w2", af.returns_no_future, args=(3,), timeout=BOUND).to_here(
        BOUND
    ),
}


@pytest.mark.parametrize("how", sorted(_NO_FUTURE))
def test_async_execution_returning_no_future_fails_the_call_only(group: Group, how: str) -> None:
    with pytest.raises(asyncrpc.AsyncExecutionError, match="got int"):
        _NO_FUTURE[how]()
    assert asyncrpc.rpc_sync("w2", fns.add, args=(1, 2), timeout=BOUND) == 3
