"""The span timeline drawn for the docs (``bench/trace_svg.py``): nesting, order, a
well-formed SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from bench.trace_svg import render, rows


def span(span_id: str, parent: str | None, start: int, end: int, kind: str = "SERVER",
         worker: str = "w0", status: str = "UNSET") -> dict[str, Any]:  # fmt: skip
    return {
        "worker": worker, "name": f"mod.fn_{span_id}", "kind": kind, "span_id": span_id,
        "parent_id": parent, "start": start, "end": end, "status": status,
        "attributes": {"asyncrpc.caller": "w0", "asyncrpc.callee": "w1"},
    }  # fmt: skip


def test_trace_svg_rows_nest_children_under_parents_by_start() -> None:
    spans = [
        span("c2", "root", 30, 40), span("root", None, 0, 100, "INTERNAL"),
        span("c1", "root", 10, 20, "CLIENT"), span("g", "c1", 12, 18, worker="w1"),
        span("orphan", "not-exported", 50, 60),
    ]  # fmt: skip
    assert [(depth, s["span_id"]) for depth, s in rows(spans)] == [
        (0, "root"), (1, "c1"), (2, "g"), (1, "c2"), (0, "orphan"),
    ]  # fmt: skip


def test_trace_svg_render_is_well_formed_with_one_bar_per_span() -> None:
    spans = [span("a", None, 0, 2_000_000, "CLIENT"), span("b", "a", 1, 1_000_000,
             worker="w1", status="ERROR")]  # fmt: skip
    svg = ET.fromstring(render(spans, "a <title> & more"))
    bars = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.find("*") is not None]
    assert len(bars) == 2
    assert bars[1].get("stroke") == "#D00000"  # the failed span is marked
    assert bars[0].get("fill") != bars[1].get("fill")  # a colour per worker
