"""RPCs under torch's legacy profiler (``torch.autograd.profiler_legacy.profile``, which
torch's RPC tests use), node ids, torch's names, nested RPCs and RRef profiling, with real
worker processes over 127.0.0.1.

The driver (this process, rank 0) profiles; w1 and w3 serve on their thread pools, w2 on
its loop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.profiler import record_function
from torch.autograd.profiler_legacy import profile as legacy_profile
from torch.profiler import profile

import asyncrpc
from asyncrpc.profiling import REMOTE_OP, rpc_span_name
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def named(events: Any, name: str) -> list[Any]:
    return [e for e in events if e.name == name]


def test_legacy_profiler_rpc_span_has_the_callers_node_id(group: Group) -> None:
    with legacy_profile() as prof:
        asyncrpc.rpc_sync("w1", fns.torch_ops, args=(torch.ones(4, 4),))
    span = rpc_span_name("sync", "torch_ops", "driver", "w1")
    (local,) = named(prof.function_events, span)
    assert (local.node_id, local.is_remote) == (0, False)
    remote = [e for e in prof.function_events if e.name.startswith(span + REMOTE_OP)]
    assert {e.name[len(span + REMOTE_OP) :] for e in remote} >= {"aten::mm", "aten::add"}
    assert {(e.node_id, e.is_remote) for e in remote} == {(1, True)}


def test_legacy_profiler_rpc_async_span_inside_its_record_function_scope(group: Group) -> None:
    with legacy_profile() as prof, record_function("scope"):
        asyncrpc.rpc_async("w3", fns.sleep, args=(0.05,)).wait()
    (scope,) = named(prof.function_events, "scope")
    (span,) = named(prof.function_events, rpc_span_name("async", "sleep", "driver", "w3"))
    # The span ends before the future completes, so inside the scope that waited for it.
    assert scope.time_range.start <= span.time_range.start
    assert span.time_range.end <= scope.time_range.end
    assert span.time_range.elapsed_us() >= 50_000


def test_legacy_profiler_builtin_is_named_and_recorded_as_torch_names_it(group: Group) -> None:
    t = torch.ones(10, 3)
    with legacy_profile(record_shapes=True) as prof:
        asyncrpc.rpc_sync("w1", torch.add, args=(t, t))
    span = rpc_span_name("sync", "aten::add", "driver", "w1")
    remote = [e for e in prof.function_events if e.is_remote]
    # The op is the function: no row of our own repeats it.
    assert remote[0].name == span + REMOTE_OP + "aten::add"
    assert remote[0].input_shapes == [[10, 3], [10, 3], []]


def test_legacy_profiler_remote_shapes_and_memory_only_when_asked(group: Group) -> None:
    t = torch.ones(64, 64)
    with legacy_profile(profile_memory=True) as prof:
        asyncrpc.rpc_sync("w1", fns.torch_ops, args=(t,))
    remote = [e for e in prof.function_events if e.is_remote]
    assert max(e.cpu_memory_usage for e in remote) >= 64 * 64 * 4
    assert all(e.input_shapes == [] for e in remote)
    with legacy_profile() as prof:
        asyncrpc.rpc_sync("w1", fns.torch_ops, args=(t,))
    assert {e.cpu_memory_usage for e in prof.function_events} == {0}


def test_legacy_profiler_remote_record_function_has_its_ops_as_children(group: Group) -> None:
    with legacy_profile() as prof:
        asyncrpc.rpc_sync("w3", fns.scoped_torch_ops, args=(torch.ones(4, 4),))
    (scope,) = [e for e in prof.function_events if e.name.endswith(REMOTE_OP + "##scope##")]
    assert scope.node_id == 3
    children = {e.name.rpartition(REMOTE_OP)[2] for e in scope.cpu_children}
    assert {"aten::mm", "aten::add"} <= children


@pytest.mark.parametrize("fn", [fns.nested_torch_add, fns.async_exec_torch_add])
def test_legacy_profiler_rpc_made_by_the_callee_is_nested_with_its_node(
    group: Group, fn: Any
) -> None:
    with legacy_profile() as prof:
        value = asyncrpc.rpc_sync("w1", fn, args=("w3", torch.ones(2, 2)))
    assert value.shape == (2, 2)
    outer = rpc_span_name("sync", fn.__qualname__, "driver", "w1")
    inner = outer + REMOTE_OP + rpc_span_name("sync", "aten::add", "w1", "w3")
    if fn is fns.async_exec_torch_add:
        inner = outer + REMOTE_OP + rpc_span_name("async", "aten::add", "w1", "w3")
    (inner_span,) = named(prof.function_events, inner)
    assert inner_span.node_id == 1  # it ran on w1
    (inner_add,) = named(prof.function_events, inner + REMOTE_OP + "aten::add")
    assert inner_add.node_id == 3  # the op ran on w3
    # The nested span starts inside w1's function (and ends inside it when the function
    # waits for it: an async_execution one returns first), the op inside the nested span.
    (function,) = named(prof.function_events, outer + REMOTE_OP + f"{fns.__name__}.{fn.__name__}")
    assert function.time_range.start <= inner_span.time_range.start
    if fn is fns.nested_torch_add:
        assert inner_span.time_range.end <= function.time_range.end
    assert inner_span.time_range.start <= inner_add.time_range.start
    assert inner_add.time_range.end <= inner_span.time_range.end


@pytest.mark.parametrize("owner", ["w1", "driver"])
def test_rref_profiling_future_is_done_once_the_remote_span_is(group: Group, owner: str) -> None:
    with legacy_profile() as prof:
        rref = asyncrpc.remote(owner, fns.torch_ops, args=(torch.ones(4, 4),))
        rref._get_profiling_future().wait()
    span = rpc_span_name("remote", "torch_ops", "driver", owner)
    (local,) = named(prof.function_events, span)
    assert local.node_id == 0
    assert named(prof.function_events, span + REMOTE_OP + "aten::mm")
    # Not made by a profiled remote(): done at once.
    assert asyncrpc.remote("w1", fns.add, args=(1, 2))._get_profiling_future().done()


def test_rref_get_type_span_has_torchs_name(group: Group) -> None:
    rref = asyncrpc.remote("w3", torch.add, args=(torch.ones(2), 1))
    with legacy_profile() as prof:
        assert rref._get_type() is torch.Tensor
    names = [e.name for e in prof.function_events]
    assert rpc_span_name("async", "_rref_typeof_on_owner", "driver", "w3") in names


def test_profiler_node_ids_only_in_profiles_with_rpcs(group: Group) -> None:
    with profile() as prof:
        asyncrpc.rpc_sync("w1", fns.torch_ops, args=(torch.ones(4, 4),))
        torch.ones(3).sum()
    local = [e for e in prof.events() if not e.is_remote]
    assert {e.node_id for e in local} == {0}
    with profile() as prof:
        torch.ones(3).sum()
    assert {e.node_id for e in prof.events()} == {-1}
    with legacy_profile() as legacy:
        torch.ones(3).sum()
    assert {e.node_id for e in legacy.function_events} == {-1}
