"""RPCs in torch.profiler traces, with real worker processes over 127.0.0.1.

The driver (this process) profiles; w1 and w3 serve on their thread pools, w2 on its loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile
from torch.profiler import profile

import asyncrpc
from asyncrpc.profiling import (
    disable_server_profiler,
    enable_server_profiler,
    remote_event_name,
    rpc_span_name,
)
from asyncrpc.profiling.recorder import ASKED, MEMORY, SHAPES
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.runtime.calls.pipeline import CallKind, Pipeline
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)

# The callee names the function it ran in full; the caller's span, as torch does, by its
# __qualname__.
OPS = "tests.integration.remote_fns.torch_ops"
ASYNC_OPS = "tests.integration.remote_fns.async_torch_ops"


def counts(prof: Any) -> dict[str, int]:
    return {e.key: e.count for e in prof.key_averages()}


def test_profiler_rpc_sync_span_and_remote_ops(group: Group) -> None:
    with profile() as prof:
        asyncrpc.rpc_sync("w1", fns.torch_ops, args=(torch.ones(8, 8),))
    found = counts(prof)
    span = rpc_span_name("sync", "torch_ops", "driver", "w1")
    assert span == "rpc_sync#torch_ops(driver -> w1)"
    assert found[span] == 1
    assert found[remote_event_name(span, OPS)] == 1  # the function, run on w1
    assert found[f"{span}#remote_op: aten::mm"] == 1
    assert found[f"{span}#remote_op: aten::add"] == 1


def test_profiler_rpc_async_spans_are_counted_per_call(group: Group) -> None:
    with profile() as prof:
        futures = [asyncrpc.rpc_async("w3", fns.torch_ops, args=(torch.ones(4, 4),))]
        futures += [asyncrpc.rpc_async("w3", fns.torch_ops, args=(torch.ones(4, 4),))]
        futures += [asyncrpc.rpc_async("w3", fns.torch_ops, args=(torch.ones(4, 4),))]
        asyncrpc.wait_all(futures)
    found = counts(prof)
    span = rpc_span_name("async", "torch_ops", "driver", "w3")
    assert found[span] == 3
    assert found[f"{span}#remote_op: aten::mm"] == 3


def test_profiler_remote_events_are_marked_remote_with_the_callee_rank(group: Group) -> None:
    with profile() as prof:
        asyncrpc.rpc_sync("w3", fns.torch_ops, args=(torch.ones(4, 4),))
    remote = [e for e in prof.events() if "#remote_op: " in e.name]
    assert remote
    assert {(e.is_remote, e.node_id) for e in remote} == {(True, 3)}
    local = [
        e for e in prof.events() if e.name == rpc_span_name("sync", "torch_ops", "driver", "w3")
    ]
    function = next(e for e in remote if e.name.endswith(OPS))
    # The remote function is placed inside the local span of its RPC.
    assert local[0].time_range.start <= function.time_range.start
    assert function.time_range.end <= local[0].time_range.end + 1


def test_profiler_async_def_callee_ops_are_recorded(group: Group) -> None:
    with profile() as prof:
        asyncrpc.rpc_sync("w2", fns.async_torch_ops, args=(torch.ones(4, 4),))
    found = counts(prof)
    span = rpc_span_name("sync", "async_torch_ops", "driver", "w2")
    assert found[span] == 1
    # Both steps of the coroutine: mm before its await, sub after it.
    assert found[f"{span}#remote_op: aten::mm"] == 1
    assert found[f"{span}#remote_op: aten::sub"] == 1


def test_profiler_remote_and_to_here_spans(group: Group) -> None:
    with profile() as prof:
        rref = asyncrpc.remote("w1", fns.torch_ops, args=(torch.ones(4, 4),))
        value = rref.to_here()
        sum_of = rref.rpc_sync().sum()
    assert torch.equal(value, torch.full((4, 4), 5.0))
    assert sum_of.item() == 80.0
    found = counts(prof)
    remote_span = rpc_span_name("remote", "torch_ops", "driver", "w1")
    assert found[remote_span] == 1
    assert found[f"{remote_span}#remote_op: aten::mm"] == 1
    assert found[rpc_span_name("sync", "RRef.to_here", "driver", "w1")] == 1
    assert found[rpc_span_name("sync", "RRef.sum", "driver", "w1")] == 1


def test_profiler_await_call_from_another_loop(group: Group) -> None:
    async def calls() -> None:
        await asyncrpc.call("w2", fns.torch_ops, torch.ones(4, 4))

    with profile() as prof:
        asyncio.run(calls())
    span = rpc_span_name("async", "torch_ops", "driver", "w2")
    assert counts(prof)[f"{span}#remote_op: aten::mm"] == 1


def test_profiler_await_call_on_the_agents_own_loop(group: Group) -> None:
    # w2 runs init_rpc_async: it profiles an `await call` made on its agent's loop.
    keys = asyncrpc.rpc_sync("w2", fns.profile_await_call_here, args=("w1",))
    span = rpc_span_name("async", "torch_ops", "w2", "w1")
    assert span in keys
    assert f"{span}#remote_op: aten::mm" in keys


def test_profiler_failed_call_still_has_its_span_and_remote_ops(group: Group) -> None:
    with profile() as prof, pytest.raises(fns.CustomError):
        asyncrpc.rpc_sync("w1", fns.torch_ops_then_fail, args=(torch.ones(4, 4),))
    span = rpc_span_name("sync", "torch_ops_then_fail", "driver", "w1")
    found = counts(prof)
    assert found[span] == 1
    assert found[f"{span}#remote_op: aten::mm"] == 1


def test_profiler_off_means_no_spans_and_no_header_fields(group: Group) -> None:
    agent = current_agent()

    def request_fields() -> list[Any]:
        encoded = agent.outbox.encode(1, fns.noop, (), {}, 5.0, CallKind.SYNC)
        if encoded.observed is not None:  # never sent: close the span it opened
            Pipeline.completed(*encoded.observed, None, None)
        decoder = FrameDecoder()
        frames = [f for piece in encoded.pieces for f in decoder.feed(piece)]
        assert len(frames) == 1
        return frames[0].fields

    assert len(request_fields()) == 7  # no pipeline field at all
    with profile():
        assert request_fields()[7] == {"p": 1}
    assert len(request_fields()) == 7
    # The legacy profiler too, asking for what it records (see recorder.py's bits).
    with legacy_profile(record_shapes=True, profile_memory=True):
        assert request_fields()[7] == {"p": ASKED | SHAPES | MEMORY}
    with legacy_profile(record_shapes=True):
        assert request_fields()[7] == {"p": ASKED | SHAPES}
    assert len(request_fields()) == 7
    with profile() as prof:
        pass
    asyncrpc.rpc_sync("w1", fns.torch_ops, args=(torch.ones(2, 2),))  # after the profile
    assert not [e for e in prof.events() if e.name.startswith("rpc_")]


def test_profiler_server_side_records_every_request_served(group: Group) -> None:
    asyncrpc.rpc_sync("w3", enable_server_profiler)
    try:
        asyncrpc.rpc_sync("w3", fns.torch_ops, args=(torch.ones(4, 4),))
        asyncrpc.rpc_async("w3", fns.torch_ops, args=(torch.ones(4, 4),)).wait()
    finally:
        events = asyncrpc.rpc_sync("w3", disable_server_profiler)
    found = {e.key: e.count for e in events.key_averages()}
    # disable_server_profiler's own request started while the profiler was on.
    assert found[f"{OPS} (driver -> w3)"] == 2
    assert found["aten::mm"] == 2
    # Off again: a later request is not recorded.
    asyncrpc.rpc_sync("w3", enable_server_profiler)
    events = asyncrpc.rpc_sync("w3", disable_server_profiler)
    assert not [e for e in events if e.name.startswith(OPS)]
