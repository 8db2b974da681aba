"""Unit tests of the bench report: each ratio's direction, p99, the floor's legend, the check
against the plain program, and the targets behind their flag."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.bench.standing import MIN_TOLERANCE, agree, headline, plain_checks, spread
from asyncrpc.bench.tables import render


def _cell(value: float, rounds: list[float] | None = None) -> dict[str, Any]:
    return {"value": value, "median": {"p99_us": value * 3}, "rounds": rounds or [value]}


def _row(label: str, ratio: float | None, keys: dict[str, str] | None = None) -> dict[str, Any]:
    values = {"asyncrpc": _cell(1.0), "torch": _cell(2.0), "floor": {"value": None, "note": "n/a"}}
    return {
        "label": label,
        "keys": keys or {},
        "values": values,
        "ratios": {"asyncrpc/torch": ratio, "asyncrpc/floor": None},
        "ratios_p99": {"asyncrpc/torch": None if ratio is None else ratio * 2},
    }


def _latency_row(label: str, key: str, mine: list[float], theirs: list[float]) -> dict[str, Any]:
    import statistics

    a, t = statistics.median(mine), statistics.median(theirs)
    row = _row(label, a / t, {"asyncrpc": key, "torch": key})
    row["values"]["asyncrpc"] = _cell(a, mine)
    row["values"]["torch"] = _cell(t, theirs)
    return row


def _doc(plain_torch: list[float] | None = None) -> dict[str, Any]:
    """latency (lower is better), throughput (higher is better) and plain, whose noop row
    answers the harness's def no-op over rpc_sync."""
    plain_torch = plain_torch or [200.0, 210.0, 190.0]
    return {
        "meta": {
            "command": "python -m asyncrpc.bench",
            "machine": {"cpus": 2, "cpu_model": "cpu", "python": "3.11", "torch": "2.13"},
            "torch_modes": {},
        },
        "config": {"systems": ["asyncrpc", "torch", "floor"]},
        "status": {"asyncrpc": "ok", "torch": "ok", "floor": "ok"},
        "workloads": {
            "latency": {
                "metric": "p50_us",
                "unit": "µs",
                "higher_is_better": False,
                "ratio_kind": "time",
                "rows": [
                    _latency_row(
                        "def no-op, rpc_sync", "sync/sync", [100, 110, 90], [200, 190, 210]
                    ),
                    _row("b", 0.25),
                    _row("c", 2.0),
                ],
            },
            "throughput": {
                "metric": "calls_per_s",
                "unit": "calls/s",
                "higher_is_better": True,
                "ratio_kind": "rate",
                "rows": [_row("d", 3.0), _row("e", None)],
            },
            "plain": {
                "metric": "p50_us",
                "unit": "µs",
                "higher_is_better": False,
                "ratio_kind": "time",
                "rows": [_latency_row("rpc_sync(to, noop)", "noop", [100, 105, 95], plain_torch)],
            },
        },
        "cpu": {"idle_cores": {}, "busy_cores": {}},
        "targets": [
            {"target": "latency <= 0.5x torch", "ratio": 0.5, "bound": 0.5, "verdict": "met"}
        ],
    }


def test_headline_keeps_each_ratio_in_its_workloads_direction() -> None:
    lines = {line["workload"]: line for line in headline(_doc())}
    # latency: time ratios, never inverted: the median of 0.5, 0.25 and 2.0.
    assert lines["latency"]["kind"] == "time"
    assert lines["latency"]["ratio"] == pytest.approx(0.5)
    assert (lines["latency"]["lowest"], lines["latency"]["highest"]) == (0.25, 2.0)
    assert lines["throughput"]["kind"] == "rate"
    assert lines["throughput"]["ratio"] == pytest.approx(3.0)
    assert lines["throughput"]["rows"] == 1  # a row without a ratio does not count


def test_report_says_which_way_each_ratio_reads_in_every_ratio_column() -> None:
    text = render(_doc())
    latency = text[text.index("== latency") : text.index("== throughput")]
    throughput = text[text.index("== throughput") : text.index("== plain")]
    # Each ratio header names the pair, the statistic, the kind and the direction.
    assert "p50 time, <1x faster" in latency
    assert "p99 time, <1x faster" in latency  # the tail beside the median
    assert "rate, >1x faster" in throughput
    assert "time" not in throughput.splitlines()[1]
    assert "0.50x" in latency  # the raw ratio, not its inverse (2.00x)
    assert "1.00x" in latency  # p99 ratio of the first row: 0.5 * 2
    # The headline reads the same way as the tables.
    assert "time  0.50x (below 1x: asyncrpc faster, 3 rows: 0.25x to 2.00x)" in text
    assert "rate  3.00x (above 1x: asyncrpc faster)" in text
    assert "x better" not in text


def test_report_explains_the_floor_when_it_ran() -> None:
    doc = _doc()
    assert "floor: no RPC at all, a raw uvloop socket" in render(doc)
    doc["config"]["systems"] = ["asyncrpc", "torch"]
    assert "floor:" not in render(doc)


def test_report_leaves_out_systems_that_answer_nothing_in_a_workload() -> None:
    text = render(_doc())
    plain = text[text.index("== plain") :].split("\n\n")[0]
    header = "\n".join(plain.splitlines()[1:3])
    assert "floor" not in header  # no floor column, no asyncrpc/floor ratio
    assert "asyncrpc/torch" in header


def test_check_against_the_plain_program_agrees_within_the_spread() -> None:
    (check,) = plain_checks(_doc())
    assert check["verdict"] == "agrees"
    assert check["systems"]["torch"]["harness"] == 200
    assert check["systems"]["torch"]["plain"] == 200
    assert check["ratio"]["harness"] == pytest.approx(0.5)
    text = render(_doc())
    assert "agrees with the plain program (1 row)" in text
    assert "def no-op, rpc_sync (noop)" in text


def test_a_harness_row_that_disagrees_with_the_plain_program_is_not_a_headline() -> None:
    # torch 40% faster in the plain program than in the harness, rounds within 5%.
    doc = _doc(plain_torch=[140.0, 145.0, 138.0])
    (check,) = plain_checks(doc)
    assert check["verdict"] == "disagrees"
    assert not check["systems"]["torch"]["agrees"]
    assert check["systems"]["asyncrpc"]["agrees"]
    (latency,) = [line for line in headline(doc) if line["workload"] == "latency"]
    assert latency["plain"] == "disagrees"
    assert "DISAGREES with the plain program: not a figure to quote" in render(doc)


def test_check_compares_the_ratios_the_report_prints() -> None:
    # The harness's median of per-round ratios (0.5, 0.6, 0.75: 0.6) is not its ratio of
    # medians (100 / 200: 0.5). The check compares the former, so it prints the former: its
    # difference is the one a reader computes from the two ratios printed beside it.
    doc = _doc()
    row = _latency_row("def no-op, rpc_sync", "sync/sync", [100, 60, 300], [200, 100, 400])
    doc["workloads"]["latency"]["rows"][0] = row
    (check,) = plain_checks(doc)
    ratio = check["ratio"]
    assert ratio["harness"] == pytest.approx(0.6)
    assert ratio["diff"] == pytest.approx(ratio["harness"] / ratio["plain"] - 1)
    assert "0.60x (+20%" in render(doc)


def test_agree_uses_the_rounds_spread_and_a_floor_of_its_own() -> None:
    assert agree([100.0], [110.0])[0]  # 10% apart, within the 15% floor
    assert not agree([100.0], [130.0])[0]
    ok, diff, tolerance = agree([100.0, 160.0, 120.0], [150.0, 140.0, 145.0])
    assert ok  # 120 vs 145: -17%, within the harness rounds' own 60% spread
    assert diff == pytest.approx(120 / 145 - 1)
    assert tolerance == pytest.approx(0.6)
    assert agree([100.0], [100.0])[2] == MIN_TOLERANCE


def test_spread_of_five_rounds_leaves_out_a_stalled_one() -> None:
    # A round stalled by other jobs (11 ms) does not widen the tolerance to 8,000%.
    assert spread([262.0, 11136.0, 131.0, 222.0, 197.0]) == pytest.approx(262 / 197 - 1)
    assert spread([100.0, 150.0, 120.0]) == pytest.approx(0.5)  # few rounds: all of them
    assert spread([100.0]) == 0.0


@pytest.mark.parametrize("left_out", ["asyncrpc", "torch"])
def test_report_of_a_run_without_one_library_has_nothing_to_check(left_out: str) -> None:
    doc = _doc()
    doc["config"]["systems"] = [s for s in doc["config"]["systems"] if s != left_out]
    for summary in doc["workloads"].values():
        for row in summary["rows"]:
            del row["values"][left_out]
            row["ratios"] = {k: v for k, v in row["ratios"].items() if k != "asyncrpc/torch"}
    assert [c["verdict"] for c in plain_checks(doc)] == ["not measured"]
    text = render(doc)
    assert "== the harness against the plain program" not in text
    assert "== latency" in text


def test_report_hides_targets_unless_asked() -> None:
    assert "targets" not in render(_doc())
    assert "[         met] latency <= 0.5x torch: 0.50x" in render(_doc(), targets=True)


def test_plot_of_ratios_is_written(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from asyncrpc.bench.report import write_plot

    doc = _doc()
    doc["meta"]["date"] = "2026-11-25"
    path = tmp_path / "bench.png"
    write_plot(doc, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_prints_the_tables_ratios_and_turns_a_time_axis_round() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrpc.bench.report import _plot_panel

    doc = _doc()
    fig, (latency, throughput) = plt.subplots(2, 1)
    try:
        _plot_panel(latency, "latency", doc["workloads"]["latency"])
        _plot_panel(throughput, "throughput", doc["workloads"]["throughput"])
        # The figures the tables print (0.50x), not their inverse (2.00x); right of 1x is
        # faster in both panels, so the time axis runs from high to low.
        assert [t.get_text() for t in latency.texts] == ["0.50x", "0.25x", "2.00x"]
        assert latency.xaxis_inverted()
        assert [t.get_text() for t in throughput.texts] == ["3.00x"]
        assert not throughput.xaxis_inverted()
    finally:
        plt.close(fig)
