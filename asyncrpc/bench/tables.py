"""The human-readable report of a run: the standing against torch, the check against a plain
user program, then one table per workload and the CPU tables.

Part of ``asyncrpc.bench``; prints ``report.summarize``'s document and computes nothing new
but the layout. Every ratio column names its two systems, its kind (time or rate) and the
way it reads, in its own header.
"""

from __future__ import annotations

from typing import Any

from asyncrpc.bench.config import FLOOR_CALL_BYTES
from asyncrpc.bench.standing import MIN_TOLERANCE, headline, plain_checks, reads

__all__ = ["TITLES", "render"]

TITLES = {
    "latency": "latency: round trip of one small call",
    "throughput": "throughput: calls completed per second",
    "echo": "echo: a float32 tensor there and back, 2 x bytes / median time (MB = 10^6 B)",
    "remote": "remote() + to_here(): one RRef created and fetched",
    "ps": "parameter server: 1 server, trainers pulling and pushing a model",
    "dist-autograd": "distributed training: forward over 2 servers, dist_autograd.backward, "
    "DistributedOptimizer.step",
    "plain": "plain program: a user's own loop, perf_counter around each call, 2 fresh "
    "processes per round (no harness)",
}
_HEADLINE_NAMES = {
    "latency": "latency of one call",
    "throughput": "calls per second",
    "echo": "tensor bandwidth",
    "remote": "remote() + to_here()",
    "ps": "parameter server",
    "dist-autograd": "distributed training",
    "plain": "plain program",
}
_LATENCY_LIKE = ("latency", "remote", "plain")

# What the report says of its terms, once, under its first lines.
_LEGEND = (
    "ratios: asyncrpc's figure / the other system's, both from this run. A time ratio "
    "(latency, CPU per call) below 1x, a rate ratio (calls/s, MB/s, steps/s) above 1x: "
    "asyncrpc is faster. Each figure is the median over the rounds.",
    f"floor: no RPC at all, a raw uvloop socket on 127.0.0.1 echoing the same bytes (a "
    f"{FLOOR_CALL_BYTES}-byte frame each way for a small call): the least any Python RPC over "
    "loopback costs on this machine; asyncrpc/floor is how many times that least asyncrpc "
    "takes.",
)


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    """Columns right-aligned but the first; a header cell may span lines (``\n``)."""
    parts = [cell.split("\n") for cell in header]
    depth = max(len(p) for p in parts)
    heads = [[""] * (depth - len(p)) + p for p in parts]  # bottom-aligned
    head_rows = [[h[i] for h in heads] for i in range(depth)]
    rows = [*head_rows, *lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    fmt = [
        r[0].ljust(widths[0])
        + "  "
        + "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))
        for r in rows
    ]
    return [*fmt[:depth], "-" * max(len(f) for f in fmt), *fmt[depth:]]


def _ratio_header(pair: str, kind: str, stat: str = "") -> str:
    """e.g. ``asyncrpc/torch`` over ``p50 time, <1x faster``: the pair, the figure's kind
    and the way the ratio reads, in every ratio column."""
    sign = ">1x" if kind == "rate" else "<1x"
    return f"{pair}\n{stat + ' ' if stat else ''}{kind}, {sign} faster"


def _format_cell(cell: dict[str, Any], workload: str) -> str:
    if cell["value"] is None:
        return "n/a" if cell.get("note") == "n/a" else "-"
    text = _number(cell["value"])
    if workload in _LATENCY_LIKE:
        text += " / " + _number(cell["median"]["p99_us"])
    return text


def _render_workload(name: str, summary: dict[str, Any], systems: list[str]) -> list[str]:
    unit, kind = summary["unit"], summary["ratio_kind"]
    latency = name in _LATENCY_LIKE
    what = f"{unit} p50 / p99" if latency else unit
    better = "higher" if summary["higher_is_better"] else "lower"
    out = [f"== {TITLES[name]} ({what}, {better} is better)"]
    rows = summary["rows"]
    # Only the systems that answer this workload (no floor for ps, none but two for plain).
    systems = [s for s in systems if any(r["values"][s].get("note") != "n/a" for r in rows)]
    pairs = [p for p in (rows[0]["ratios"] if rows else {}) if set(p.split("/")) <= set(systems)]
    header = ["", *systems]
    for pair in pairs:
        header.append(_ratio_header(pair, kind, "p50" if latency else ""))
        if latency and pair == "asyncrpc/torch":  # the tail, where sync rows differ most
            header.append(_ratio_header(pair, kind, "p99"))
    lines, notes = [], []
    for row in rows:
        cells = [_format_cell(row["values"][s], name) for s in systems]
        for pair in pairs:
            cells.append(_times(row["ratios"][pair]))
            if latency and pair == "asyncrpc/torch":
                cells.append(_times(row.get("ratios_p99", {}).get(pair)))
        lines.append([row["label"], *cells])
        notes += [
            f"   {s}, {row['label']}: {row['values'][s]['note']}"
            for s in systems
            if row["values"][s]["value"] is None and row["values"][s].get("note") != "n/a"
        ]
    return [*out, *_table(header, lines), *dict.fromkeys(notes), ""]


def _render_headline(doc: dict[str, Any]) -> list[str]:
    lines = doc.get("headline") or headline(doc)
    if not lines:
        return []
    out = ["== asyncrpc against torch.distributed.rpc in this run (median of each workload's "
           "rows, lowest to highest)"]  # fmt: skip
    for line in lines:
        spread = (
            ""
            if line["rows"] == 1
            else f", {line['rows']} rows: {line['lowest']:.2f}x to {line['highest']:.2f}x"
        )
        plain = {
            "agrees": f"; agrees with the plain program ({_rows(line['plain_rows_checked'])})",
            "disagrees": "; DISAGREES with the plain program: not a figure to quote "
            "(see the check below)",
            "unchecked": "",
        }[line["plain"]]
        name = _HEADLINE_NAMES.get(line["workload"], line["workload"])
        out.append(
            f"  {name:22} {line['kind']} {line['ratio']:5.2f}x ({reads(line['kind'])}"
            f"{spread}){plain}"
        )
    return [*out, ""]


def _render_checks(doc: dict[str, Any]) -> list[str]:
    checks = [c for c in doc.get("plain_checks") or plain_checks(doc) if "systems" in c]
    if not checks:
        return []
    header = ["harness row (plain row)", "torch\nharness", "torch\nplain", "asyncrpc\nharness",
              "asyncrpc\nplain", "asyncrpc/torch time,\nharness", "round by round\nplain",
              "verdict"]  # fmt: skip
    lines = []
    for check in checks:
        sides = [check["systems"]["torch"], check["systems"]["asyncrpc"], check["ratio"]]
        cells = []
        for side, fmt in zip(sides, ("{:.1f} µs", "{:.1f} µs", "{:.2f}x"), strict=True):
            cells += [fmt.format(side["harness"]), fmt.format(side["plain"])]
            cells[-2] += f" ({side['diff']:+.0%}, ±{side['tolerance']:.0%})"
        lines.append([f"{check['label']} ({check['plain']})", *cells, check["verdict"]])
    title = (
        "== the harness against the plain program: the same call, p50 in this run. Beside each "
        "harness figure: harness / plain - 1, and the tolerance (the larger of "
        f"{MIN_TOLERANCE:.0%} and the rounds' own spread); the verdict needs all three within it. "
        "asyncrpc/torch round by round: the median of each round's ratio (both libraries ran in "
        "that round's minutes), which can differ from the tables' ratio of the medians"
    )
    return [title, *_table(header, lines), ""]


def _render_cpu(doc: dict[str, Any], systems: list[str], workloads: list[str]) -> list[str]:
    workloads = [w for w in workloads if w != "plain"]  # its processes are the program's own
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
    header = ["", *systems, "asyncrpc/torch\nCPU time, <1x less", "asyncrpc\nhand-offs"]
    lines = []
    for name, summary in doc["workloads"].items():
        for row in summary["rows"]:
            totals = {
                s: row["values"].get(s, {}).get("median", {}).get("cpu_us_total") for s in systems
            }
            if all(v is None for v in totals.values()):
                continue
            mine, theirs = totals.get("asyncrpc"), totals.get("torch")
            ratio = _times(mine / theirs) if mine is not None and theirs else "-"
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


def render(doc: dict[str, Any], targets: bool = False) -> str:
    """The human-readable report of ``summarize``'s document: each workload's ratio against
    torch, the check against the plain program, then the tables; the project's own targets
    only when asked."""
    systems = list(doc["config"]["systems"])
    out = [f"asyncrpc.bench: {doc['meta']['command']}"]
    machine = doc["meta"]["machine"]
    out.append(
        f"machine: {machine['cpus']} CPUs, {machine['cpu_model']}; python "
        f"{machine['python']}, torch {machine['torch']}"
    )
    out += [f"{s}: {m}" for s, m in doc["meta"]["torch_modes"].items()]
    out += [f"{s}: {st}" for s, st in doc["status"].items() if st != "ok"]
    out += [*(_LEGEND if "floor" in systems else _LEGEND[:1]), ""]
    out += _render_headline(doc)
    out += _render_checks(doc)
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
