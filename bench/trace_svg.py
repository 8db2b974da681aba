"""Draw exported spans as an SVG timeline: one row per span, each under its parent, a
colour per worker, one time axis (used by ``trace_ps.py``; no dependency but the stdlib).

    python bench/trace_svg.py SPANS.json [...] --out trace.svg

A span is a dict with ``worker``, ``name``, ``kind``, ``span_id``, ``parent_id``,
``start`` and ``end`` (ns, one clock for all: the processes ran on one host), ``status``,
``attributes`` and ``events`` (``[name, attributes]`` pairs: the ``rpc.message`` sizes
go in each bar's tooltip), as ``trace_ps.dump`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROW, BAR = 16, 10  # row height, bar height (px)
LABEL_W, PLOT_W, PAD = 380, 760, 12
TOP = 58  # the title, the legend and the axis
# Colour-blind safe (Okabe-Ito), one per worker in the order they are met.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")
INTERNAL = "#777777"  # a user's own span


def rows(spans: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The spans in drawing order, with their depth: each after its parent, siblings by
    start time. A span whose parent was not exported is a root."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children[parent].append(span)
    for group in children.values():
        group.sort(key=lambda s: (s["start"], s["kind"] != "CLIENT"))
    stack = [(0, s) for s in reversed(children[None])]
    while stack:  # depth first, without recursion (a deep chain is fine)
        depth, span = stack.pop()
        yield depth, span
        stack.extend((depth + 1, c) for c in reversed(children[span["span_id"]]))


def _step(span_ms: float) -> float:
    """The smallest round tick interval (1, 2 or 5 times a power of ten) that gives at
    most 10 ticks over ``span_ms``."""
    steps = (k * 10.0**e for e in range(-3, 8) for k in (1, 2, 5))
    return next(step for step in steps if span_ms / step <= 10)


def _label(span: dict[str, Any]) -> str:
    name = span["name"].rsplit(".", 1)[-1]
    attrs = span["attributes"]
    if span["kind"] == "CLIENT":
        return f"{name}  {attrs.get('asyncrpc.caller', span['worker'])} \u2192 " + str(
            attrs.get("asyncrpc.callee", "?")
        )
    if span["kind"] == "SERVER":
        return f"{name}  on {span['worker']}"
    return f"{name}  ({span['worker']})"


def _tooltip(span: dict[str, Any], ms: float) -> str:
    sizes = [
        f"{a['rpc.message.type']} {a['rpc.message.uncompressed_size']} B"
        for name, a in span.get("events", ())
        if name == "rpc.message"
    ]
    return " | ".join([span["name"], span["kind"], span["worker"], f"{ms:.2f} ms", *sizes])


def render(spans: list[dict[str, Any]], title: str) -> str:
    """The SVG of ``spans`` (see the module's docstring), titled ``title``."""
    ordered = list(rows(spans))
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    total_ms = max((t1 - t0) / 1e6, 1e-3)
    scale = PLOT_W / total_ms
    colours: dict[str, str] = {}
    for _, span in ordered:
        if span["kind"] != "INTERNAL":
            colours.setdefault(span["worker"], PALETTE[len(colours) % len(PALETTE)])
    height = TOP + ROW * len(ordered) + PAD
    width = LABEL_W + PLOT_W + 2 * PAD
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{PAD}" y="16" font-size="13">{escape(title)}</text>',
    ]
    out += _legend(colours)
    out += _axis(total_ms, height)
    for i, (depth, span) in enumerate(ordered):
        out += _row(i, depth, span, t0, scale, colours)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(colours: dict[str, str]) -> list[str]:
    items = [(w, c, 1.0) for w, c in colours.items()]
    items += [("client span: lighter", "#999999", 0.45), ("user span", INTERNAL, 1.0)]
    out, x = [], PAD
    for name, colour, opacity in items:
        out.append(f'<rect x="{x}" y="25" width="10" height="10" fill="{colour}" '
                   f'fill-opacity="{opacity}"/>')  # fmt: skip
        out.append(f'<text x="{x + 14}" y="34">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    return out


def _axis(total_ms: float, height: int) -> list[str]:
    step, out, tick = _step(total_ms), [], 0.0
    while tick <= total_ms + 1e-9:
        x = PAD + LABEL_W + tick * PLOT_W / total_ms
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 8}" x2="{x:.1f}" y2="{height - PAD}" '
                   'stroke="#dddddd"/>')  # fmt: skip
        out.append(f'<text x="{x:.1f}" y="{TOP - 11}" text-anchor="middle">{tick:g} ms</text>')
        tick += step
    return out


def _row(
    i: int, depth: int, span: dict[str, Any], t0: int, scale: float, colours: dict[str, str]
) -> list[str]:
    y = TOP + i * ROW
    start_ms, ms = (span["start"] - t0) / 1e6, (span["end"] - span["start"]) / 1e6
    kind = span["kind"]
    colour = colours.get(span["worker"], INTERNAL) if kind != "INTERNAL" else INTERNAL
    opacity = 0.45 if kind == "CLIENT" else 1.0
    error = ' stroke="#D00000" stroke-width="2"' if span["status"] == "ERROR" else ""
    x = PAD + LABEL_W + start_ms * scale
    return [
        f'<text x="{PAD + 10 * depth}" y="{y + BAR}">{escape(_label(span))}</text>',
        f'<rect x="{x:.1f}" y="{y + (ROW - BAR) // 2 - 2}" width="{max(ms * scale, 1.0):.1f}" '
        f'height="{BAR}" fill="{colour}" fill-opacity="{opacity}"{error}>'
        f"<title>{escape(_tooltip(span, ms))}</title></rect>",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/trace_svg.py")
    parser.add_argument("spans", type=Path, nargs="+", help="JSON lists of spans")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="spans")
    args = parser.parse_args()
    spans = [s for path in args.spans for s in json.loads(path.read_text())]
    args.out.write_text(render(spans, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
