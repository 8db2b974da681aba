"""Turn a run's measurements into the summary document (``--json``), target checks and a plot.

Part of ``asyncrpc.bench``; ``tables`` prints the document. Each figure is the median over
the measured rounds of that round's statistic (a round's p50 latency, its calls/s...), as
in PERF_NOTES. Ratios are always asyncrpc's figure divided by the other system's; each
workload says which way its ratios read (``ratio_kind``: a time below 1x, a rate above 1x,
means asyncrpc is faster; see ``standing``).
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
from asyncrpc.bench.standing import headline, plain_checks, ratio_kind
from asyncrpc.bench.tables import TITLES

__all__ = ["PlotUnavailableError", "check_plot_available", "summarize", "write_plot"]

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


def _ratio(values: dict[str, dict[str, Any]], other: str, stat: str | None = None) -> float | None:
    """asyncrpc's figure / ``other``'s: the primary one, or the median of ``stat``."""

    def figure(system: str) -> Any:
        cell = values.get(system, {})
        return cell.get("value") if stat is None else cell.get("median", {}).get(stat)

    mine, theirs = figure("asyncrpc"), figure(other)
    if mine is None or not theirs:
        return None
    return float(mine) / float(theirs)


def _workload_summary(result: RunResult, workload: str) -> dict[str, Any]:
    metric, unit, higher = PRIMARY_METRIC[workload]
    others = [o for o in ("torch", "torch_tcp", "floor") if o in result.config.systems]
    rows = []
    for row in rows_for(workload, result.config):
        values = {s: _cell(result, s, workload, row.keys.get(s)) for s in result.config.systems}
        ratios = {f"asyncrpc/{o}": _ratio(values, o) for o in others}
        entry = {"label": row.label, "keys": row.keys, "values": values, "ratios": ratios}
        if metric == "p50_us":  # latency rows: the tail beside the median
            entry["ratios_p99"] = {f"asyncrpc/{o}": _ratio(values, o, "p99_us") for o in others}
        rows.append(entry)
    return {"metric": metric, "unit": unit, "higher_is_better": higher,
            "ratio_kind": ratio_kind(higher), "rows": rows}  # fmt: skip


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
    doc: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "wall_s": result.wall_s,
            "command": "python -m asyncrpc.bench " + " ".join(argv),
            "machine": _machine(),
            "torch_modes": {s: TORCH_MODES[s] for s in result.config.systems if s in TORCH_MODES},
        },
        "config": result.config.to_json(),
        "status": result.status,
        "process_starts": result.starts,
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
    doc["plain_checks"] = plain_checks(doc)
    doc["headline"] = headline(doc)
    return doc


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
    """One panel per workload: each row's ratio to torch as a point, the same figure as the
    tables print (asyncrpc's over the other's), on a log axis whose direction is set so that
    right of the 1x line is faster for asyncrpc in every panel (a time panel's axis runs
    from high to low), so half the time and twice the rate lie at the same distance. The
    other systems (torch over TCP, the raw floor) are points of their own shape; the key
    sits under the panels, never over the data.

    Raises:
        PlotUnavailableError: matplotlib is not installed.
    """
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["workloads"])
    heights = [1.0 + 0.28 * len(doc["workloads"][n]["rows"]) for n in names]
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
        points = [(r, y) for y, row in enumerate(rows) if (r := row["ratios"].get(key))]
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
    # The figures are the tables' own (never inverted); only a time panel's axis is turned
    # round, so that every panel reads the same way: right of 1x, asyncrpc faster.
    if not higher:
        ax.invert_xaxis()
    ratio = "asyncrpc rate / torch rate" if higher else "asyncrpc time / torch time"
    ax.set_title(f"{TITLES[name]}\n{ratio} (right of 1x: asyncrpc faster)", fontsize=8)
    return handles


_RATIO_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
