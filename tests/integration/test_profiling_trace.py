"""The callee's work in the chrome traces ``torch.profiler`` exports, with real workers.

The driver (this process) profiles calls to w1 (thread pool) and w2 (its loop), exports the
trace and reads the JSON back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import profile

import asyncrpc
from asyncrpc.profiling import rpc_span_name
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def _trace(prof: Any, path: Path) -> list[dict[str, Any]]:
    prof.export_chrome_trace(str(path))
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return events


def _named(trace: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in trace if e.get("name") == name and e.get("ph") == "X"]


def _assert_inside(inner: dict[str, Any], outer: dict[str, Any]) -> None:
    assert (inner["pid"], inner["tid"]) == (outer["pid"], outer["tid"])  # nested: one track
    assert outer["ts"] <= inner["ts"]
    assert inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 0.01  # float rounding


@pytest.mark.parametrize(("mode", "callee", "rank"), [("sync", "w1", 1), ("async", "w2", 2)])
def test_profiler_chrome_trace_holds_the_callees_ops_under_the_rpc_span(
    group: Group, tmp_path: Path, mode: str, callee: str, rank: int
) -> None:
    fn = fns.torch_ops if callee == "w1" else fns.async_torch_ops
    with profile() as prof:
        if mode == "sync":
            asyncrpc.rpc_sync(callee, fn, args=(torch.ones(8, 8),))
        else:
            asyncrpc.rpc_async(callee, fn, args=(torch.ones(8, 8),)).wait()
    trace = _trace(prof, tmp_path / "trace.json")
    span_name = rpc_span_name(mode, fn.__qualname__, "driver", callee)
    (span,) = _named(trace, span_name)
    (mm,) = _named(trace, f"{span_name}#remote_op: aten::mm")
    assert mm["args"]["node_id"] == rank
    assert mm["args"]["worker"] == callee
    _assert_inside(mm, span)
    # torch's own local events are still there, untouched.
    assert any(e.get("name") == "aten::ones" for e in trace)


def test_profiler_chrome_trace_places_each_calls_ops_in_its_own_span(
    group: Group, tmp_path: Path
) -> None:
    with profile() as prof:
        for _ in range(3):
            asyncrpc.rpc_sync("w1", fns.torch_ops, args=(torch.ones(4, 4),))
    trace = _trace(prof, tmp_path / "trace.json")
    span_name = rpc_span_name("sync", "torch_ops", "driver", "w1")
    spans = sorted(_named(trace, span_name), key=lambda e: e["ts"])
    ops = sorted(_named(trace, f"{span_name}#remote_op: aten::mm"), key=lambda e: e["ts"])
    assert len(spans) == len(ops) == 3
    for op, span in zip(ops, spans, strict=True):
        _assert_inside(op, span)


def test_profiler_chrome_trace_without_rpcs_is_torchs_own(tmp_path: Path) -> None:
    with profile() as prof:
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    trace = _trace(prof, tmp_path / "trace.json")
    assert not [e for e in trace if e.get("cat") == "rpc_remote_op"]
