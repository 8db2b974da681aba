"""Turn a run's measurements into tables, ratios, target checks, JSON and a plot.

Part of ``asyncrpc.bench``. Each figure is the median over the measured rounds of that
round's statistic (a round's p50 latency, its calls/s...), as in PERF_NOTES. Ratios are
always asyncrpc's figure divided by the other system's, whichever way is better.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from asyncrpc.bench.config import MIB, PRIMARY_METRIC, rows_for
from asyncrpc.bench.runner import RunResult

__all__ = ["PlotUnavailableError", "check_plot_available", "render", "summarize", "write_plot"]

TORCH_MODES = {
    "torch": "torch.distributed.rpc, TensorPipe defaults (one host: shared-memory transport)",
    "torch_tcp": 'torch.distributed.rpc, TensorPipe forced to TCP (_transports=["uv"], '
    '_channels=["basic"])',
}


@dataclass(frozen=True, slots=True)
class Target:
    """A goal from the issue: asyncrpc's row ``key`` of ``workload``, ``ratio`` vs a bound."""

    workload: str
    key: str
    ratio: str  # "asyncrpc/torch" or "asyncrpc/floor"
    at_most: bool
    bound: float
    text: str


# The speed issue 13 asks for (same-host fast path and small calls), and the training
# target of the autograd issue; every ratio is against torch's default options.
TARGETS = (
    Target("latency", "sync/sync", "asyncrpc/torch", True, 0.35,
            "def no-op p50 via rpc_sync <= 0.35x torch"),
    Target("latency", "async/await", "asyncrpc/torch", True, 0.15,
            "async def no-op p50 via await call <= 0.15x torch"),
    Target("latency", "inline/await", "asyncrpc/torch", True, 0.15,
            "@inline def no-op p50 via await call <= 0.15x torch's def"),
    Target("latency", "async/await", "asyncrpc/floor", True, 2.0,
            "async def no-op p50 via await call within 2x of the raw floor"),
    Target("latency", "inline/await", "asyncrpc/floor", True, 2.0,
            "@inline def no-op p50 via await call within 2x of the raw floor"),
    Target("latency", "builtin/sync", "asyncrpc/torch", True, 0.5,
            "torch.add p50 via rpc_sync <= 0.5x torch"),
    Target("remote", "value/sync", "asyncrpc/torch", True, 0.5,
            "remote()+to_here() p50 <= 0.5x torch"),
    Target("throughput", "sync/256/await", "asyncrpc/torch", False, 6.0,
            "throughput at 256 in flight (def no-op, await call) >= 6x torch"),
    Target("throughput", "async/256/await", "asyncrpc/torch", False, 6.0,
            "throughput at 256 in flight (async def no-op, await call) >= 6x torch"),
    *(
        Target("echo", str(size * MIB), "asyncrpc/torch", False, 2.0,
                f"{size} MiB echo bandwidth >= 2x torch")
        for size in (1, 16, 64)
    ),
    Target("dist-autograd", "steps", "asyncrpc/torch", False, 2.0,
            "distributed training steps/s >= 2x torch"),
)  # fmt: skip


class PlotUnavailableError(RuntimeError):
    """``--plot`` needs matplotlib, which is not installed."""


# -- summary (the JSON document) ------------------------------------------------------------


def _cell(result: RunResult, system: str, workload: str, key: str | None) -> dict[str, Any]:
    if key is None or system not in result.config.systems:
        return {"value": None, "note": "n/a"}
    status = result.status.get(system, "not run")
    outcomes = result.raw.get(system, {}).get(workload, {}).get(key, [])
    if not outcomes:
        return {"value": None, "note": status if status != "ok" else "not measured"}
    for bad in ("unavailable", "error"):
        found = next((o[bad] for o in outcomes if bad in o), None)
        if found is not None:
            return {"value": None, "note": f"{bad}: {found}"}
    stats = [o["stats"] for o in outcomes]
    medians = {
        name: statistics.median(s[name] for s in stats)
        for name, first in stats[0].items()
        if isinstance(first, int | float)
    }
    metric = PRIMARY_METRIC[workload][0]
    return {"value": medians[metric], "median": medians, "rounds": [s[metric] for s in stats]}


def _ratio(values: dict[str, dict[str, Any]], other: str) -> float | None:
    mine, theirs = values.get("asyncrpc", {}).get("value"), values.get(other, {}).get("value")
    if mine is None or not theirs:
        return None
    return float(mine) / float(theirs)


def _workload_summary(result: RunResult, workload: str) -> dict[str, Any]:
    metric, unit, higher = PRIMARY_METRIC[workload]
    rows = []
    for row in rows_for(workload, result.config):
        values = {s: _cell(result, s, workload, row.keys.get(s)) for s in result.config.systems}
        ratios = {
            f"asyncrpc/{o}": _ratio(values, o)
            for o in ("torch", "torch_tcp", "floor")
            if o in result.config.systems
        }
        rows.append({"label": row.label, "keys": row.keys, "values": values, "ratios": ratios})
    return {"metric": metric, "unit": unit, "higher_is_better": higher, "rows": rows}


def _targets(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for target in TARGETS:
        rows = workloads.get(target.workload, {}).get("rows", [])
        row = next((r for r in rows if r["keys"].get("asyncrpc") == target.key), None)
        ratio = None if row is None else row["ratios"].get(target.ratio)
        if ratio is None:
            verdict = "not measured"
        else:
            met = ratio <= target.bound if target.at_most else ratio >= target.bound
            verdict = "met" if met else "missed"
        checks.append(
            {"target": target.text, "ratio": ratio, "bound": target.bound, "verdict": verdict}
        )
    return checks


def _machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    import torch
    import uvloop

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "uvloop": getattr(uvloop, "__version__", "?"),
    }


def summarize(result: RunResult, argv: list[str]) -> dict[str, Any]:
    """The JSON document of a run (what ``--json`` writes)."""
    workloads = {w: _workload_summary(result, w) for w in result.config.workloads}
    return {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "wall_s": result.wall_s,
            "command": "python -m asyncrpc.bench " + " ".join(argv),
            "machine": _machine(),
            "torch_modes": {s: TORCH_MODES[s] for s in result.config.systems if s in TORCH_MODES},
        },
        "config": result.config.to_json(),
        "status": result.status,
        "workloads": workloads,
        "cpu": {
            "idle_cores": result.cpu_idle,
            "busy_cores": {
                s: {w: statistics.median(v) for w, v in per.items()}
                for s, per in result.cpu_busy.items()
            },
        },
        "targets": _targets(workloads),
    }


# -- text tables ----------------------------------------------------------------------------

_TITLES = {
    "latency": "latency: round trip of one small call",
    "throughput": "throughput: calls completed per second",
    "echo": "echo: a float32 tensor there and back, 2 x bytes / median time (MB = 10^6 B)",
    "remote": "remote() + to_here(): one RRef created and fetched",
    "ps": "parameter server: 1 server, trainers pulling and pushing a model",
    "dist-autograd": "distributed training: forward over 2 servers, dist_autograd.backward, "
    "DistributedOptimizer.step",
}


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _format_cell(cell: dict[str, Any], workload: str) -> str:
    if cell["value"] is None:
        return "n/a" if cell.get("note") == "n/a" else "-"
    text = _number(cell["value"])
    if workload in ("latency", "remote"):
        text += " / " + _number(cell["median"]["p99_us"])
    return text


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    fmt = [
        r[0].ljust(widths[0])
        + "  "
        + "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))
        for r in [header, *lines]
    ]
    return [fmt[0], "-" * len(fmt[0]), *fmt[1:]]


def _render_workload(name: str, summary: dict[str, Any], systems: list[str]) -> list[str]:
    unit, higher = summary["unit"], summary["higher_is_better"]
    what = f"{unit} p50 / p99" if name in ("latency", "remote") else unit
    out = [f"== {_TITLES[name]} ({what}, {'higher' if higher else 'lower'} is better)"]
    ratio_names = list(summary["rows"][0]["ratios"]) if summary["rows"] else []
    header = ["", *systems, *ratio_names]
    lines, notes = [], []
    for row in summary["rows"]:
        cells = [_format_cell(row["values"][s], name) for s in systems]
        ratios = [f"{r:.2f}x" if r is not None else "-" for r in row["ratios"].values()]
        lines.append([row["label"], *cells, *ratios])
        notes += [
            f"   {s}, {row['label']}: {row['values'][s]['note']}"
            for s in systems
            if row["values"][s]["value"] is None and row["values"][s].get("note") != "n/a"
        ]
    return [*out, *_table(header, lines), *dict.fromkeys(notes), ""]


def _render_cpu(doc: dict[str, Any], systems: list[str], workloads: list[str]) -> list[str]:
    header = ["system", "idle", *workloads]
    lines = []
    for system in systems:
        idle = doc["cpu"]["idle_cores"].get(system)
        busy = doc["cpu"]["busy_cores"].get(system, {})
        cells = [f"{busy[w]:.2f}" if w in busy else "-" for w in workloads]
        lines.append([system, "-" if idle is None else f"{idle:.2f}", *cells])
    title = "== CPU use of each system's processes, in cores (1.00 = one core busy)"
    return [title, *_table(header, lines), ""]


def _render_cpu_per_call(doc: dict[str, Any], systems: list[str]) -> list[str]:
    """Per workload row: each system's CPU microseconds per call, all its processes
    together (client + server [+ trainer]), and asyncrpc's ratio to torch's."""
    header = ["", *systems, "asyncrpc/torch", "asyncrpc hand-offs"]
    lines = []
    for name, summary in doc["workloads"].items():
        for row in summary["rows"]:
            totals = {s: row["values"][s].get("median", {}).get("cpu_us_total") for s in systems}
            if all(v is None for v in totals.values()):
                continue
            mine, theirs = totals.get("asyncrpc"), totals.get("torch")
            ratio = f"{mine / theirs:.2f}x" if mine is not None and theirs else "-"
            cells = ["-" if v is None else _number(v) for v in totals.values()]
            ours = row["values"].get("asyncrpc", {}).get("median", {})
            handoffs = ours.get("handoffs_total")
            moved = "-"
            if handoffs is not None:
                parts = f"{ours['handoffs_client']:.1f} + {ours['handoffs_server']:.1f}"
                moved = f"{handoffs:.1f} ({parts})"
            lines.append([f"{name} {row['label']}", *cells, ratio, moved])
    if not lines:
        return []
    title = (
        "== CPU time per call, microseconds, every process of the system (user + system; "
        "lower is better; steadier than wall time on a shared machine); asyncrpc's thread "
        "hand-offs per call (client + server)"
    )
    return [title, *_table(header, lines), ""]


def headline(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each workload's standing against torch in this run: how many times better asyncrpc
    is (above 1: better; the median over the workload's rows, with the lowest and highest),
    whatever the metric's direction."""
    lines = []
    for name, summary in doc["workloads"].items():
        higher = summary["higher_is_better"]
        ratios = []
        for row in summary["rows"]:
            ratio = row["ratios"].get("asyncrpc/torch")
            if ratio:
                ratios.append(ratio if higher else 1.0 / ratio)
        if ratios:
            lines.append(
                {"workload": name, "times_better": statistics.median(ratios),
                 "lowest": min(ratios), "highest": max(ratios), "rows": len(ratios)}
            )  # fmt: skip
    return lines


_HEADLINE_NAMES = {
    "latency": "latency of one call",
    "throughput": "calls per second",
    "echo": "tensor bandwidth",
    "remote": "remote() + to_here()",
    "ps": "parameter server",
    "dist-autograd": "distributed training",
}


def _render_headline(doc: dict[str, Any]) -> list[str]:
    lines = headline(doc)
    if not lines:
        return []
    out = ["== asyncrpc against torch.distributed.rpc in this run (x better; above 1x: faster)"]
    for line in lines:
        spread = (
            ""
            if line["rows"] == 1
            else f"   ({line['rows']} rows: {line['lowest']:.2f}x to {line['highest']:.2f}x)"
        )
        out.append(
            f"  {_HEADLINE_NAMES.get(line['workload'], line['workload']):24}"
            f"{line['times_better']:6.2f}x{spread}"
        )
    return [*out, ""]


def render(doc: dict[str, Any], targets: bool = False) -> str:
    """The human-readable report of ``summarize``'s document: first each workload's ratio
    against torch, then the tables; the project's own targets only when asked."""
    systems = list(doc["config"]["systems"])
    out = [f"asyncrpc.bench: {doc['meta']['command']}"]
    machine = doc["meta"]["machine"]
    out.append(
        f"machine: {machine['cpus']} CPUs, {machine['cpu_model']}; python "
        f"{machine['python']}, torch {machine['torch']}"
    )
    out += [f"{s}: {m}" for s, m in doc["meta"]["torch_modes"].items()]
    out += [f"{s}: {st}" for s, st in doc["status"].items() if st != "ok"]
    out.append("")
    out += _render_headline(doc)
    for name, summary in doc["workloads"].items():
        out += _render_workload(name, summary, systems)
    out += _render_cpu(doc, systems, list(doc["workloads"]))
    out += _render_cpu_per_call(doc, systems)
    if targets:
        out.append("== the project's targets (ratios from this run)")
        for check in doc["targets"]:
            ratio = "" if check["ratio"] is None else f": {check['ratio']:.2f}x"
            out.append(f"  [{check['verdict']:>12}] {check['target']}{ratio}")
    return "\n".join(out) + "\n"


# -- plot -----------------------------------------------------------------------------------


def check_plot_available() -> None:
    """Raise ``PlotUnavailableError`` early when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailableError(
            # Not `asyncrpc[plot]`: the PyPI package named asyncrpc is an unrelated project
            # (ours is distributed as asyncrpc-torch, not on PyPI), so name matplotlib itself.
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from exc


def write_plot(doc: dict[str, Any], path: str) -> None:
    """One panel per workload: each row's ratio to torch as a point, oriented so that right
    of the 1x line is better for asyncrpc, on a log axis (2x better and 2x worse lie at
    the same distance). The other systems (torch over TCP, the raw floor) are points of
    their own shape; the key sits under the panels, never over the data.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
    """
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["workloads"])
    heights = [0.8 + 0.28 * len(doc["workloads"][n]["rows"]) for n in names]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.4 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    handles: dict[str, Any] = {}
    for ax, name in zip(axes[:, 0], names, strict=True):
        handles.update(_plot_panel(ax, name, doc["workloads"][name]))
    machine = doc["meta"]["machine"]
    fig.suptitle(f"asyncrpc against torch.distributed.rpc, {doc['meta']['date']}, "
                 f"{machine['cpus']} CPUs, torch {machine['torch']}", fontsize=9)  # fmt: skip
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center",
                   ncol=len(handles), fontsize=7, frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.03, 1, 0.975))
    fig.savefig(path, dpi=100)
    plt.close(fig)


_MARKERS = {"asyncrpc/torch": ("o", "asyncrpc vs torch"),
            "asyncrpc/torch_tcp": ("s", "asyncrpc vs torch over TCP"),
            "asyncrpc/floor": ("^", "asyncrpc vs the raw socket floor")}  # fmt: skip


def _plot_panel(ax: Any, name: str, summary: dict[str, Any]) -> dict[str, Any]:
    rows = summary["rows"]
    higher = summary["higher_is_better"]
    handles: dict[str, Any] = {}
    xs_all: list[float] = []
    for key, (marker, label) in _MARKERS.items():
        points = [
            (1.0 / r if not higher else r, y)
            for y, row in enumerate(rows)
            if (r := row["ratios"].get(key))
        ]
        if not points:
            continue
        xs = [x for x, _ in points]
        xs_all += xs
        handles[label] = ax.plot(xs, [y for _, y in points], marker, linestyle="none")[0]
        if key == "asyncrpc/torch":
            for x, y in points:
                ax.annotate(f"{x:.2f}x", (x, y), xytext=(4, 3), textcoords="offset points",
                            fontsize=6)  # fmt: skip
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row["label"] for row in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xscale("log")
    span = max([2.0, *xs_all, *(1.0 / x for x in xs_all if x)])
    ax.set_xlim(1.0 / (span * 1.5), span * 1.5)
    ticks = [t for t in _RATIO_TICKS if 1.0 / (span * 1.5) <= t <= span * 1.5]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_title(f"{_TITLES[name]}: x better (right of 1x: asyncrpc is better)", fontsize=8)
    return handles


_RATIO_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
