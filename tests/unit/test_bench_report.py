"""Unit tests of the bench report's headline and of the targets behind their flag."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.bench.report import headline, render


def _row(label: str, ratio: float | None) -> dict[str, Any]:
    cell = {"value": 1.0, "median": {"p99_us": 2.0}}
    values = {"asyncrpc": cell, "torch": cell}
    return {"label": label, "keys": {}, "values": values, "ratios": {"asyncrpc/torch": ratio}}


def _doc() -> dict[str, Any]:
    return {
        "meta": {
            "command": "python -m asyncrpc.bench",
            "machine": {"cpus": 2, "cpu_model": "cpu", "python": "3.11", "torch": "2.13"},
            "torch_modes": {},
        },
        "config": {"systems": ["asyncrpc", "torch"]},
        "status": {"asyncrpc": "ok", "torch": "ok"},
        "workloads": {
            # latency: lower is better, so asyncrpc/torch = 0.5 is 2x better.
            "latency": {
                "metric": "p50",
                "unit": "us",
                "higher_is_better": False,
                "rows": [_row("a", 0.5), _row("b", 0.25), _row("c", 2.0)],
            },
            "throughput": {
                "metric": "calls/s",
                "unit": "calls/s",
                "higher_is_better": True,
                "rows": [_row("d", 3.0), _row("e", None)],
            },
        },
        "cpu": {"idle_cores": {}, "busy_cores": {}},
        "targets": [
            {"target": "latency <= 0.5x torch", "ratio": 0.5, "bound": 0.5, "verdict": "met"}
        ],
    }


def test_headline_says_how_many_times_better_whatever_the_direction() -> None:
    lines = {line["workload"]: line for line in headline(_doc())}
    assert lines["latency"]["times_better"] == pytest.approx(2.0)  # median of 2, 4, 0.5
    assert lines["latency"]["lowest"] == pytest.approx(0.5)
    assert lines["latency"]["highest"] == pytest.approx(4.0)
    assert lines["throughput"]["times_better"] == pytest.approx(3.0)
    assert lines["throughput"]["rows"] == 1  # a row without a ratio does not count


def test_report_leads_with_the_headline_and_hides_targets_unless_asked() -> None:
    text = render(_doc())
    assert text.index("asyncrpc against torch") < text.index("== latency")
    assert "2.00x   (3 rows: 0.50x to 4.00x)" in text
    assert "targets" not in text
    assert "[         met] latency <= 0.5x torch: 0.50x" in render(_doc(), targets=True)


def test_plot_of_ratios_is_written(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from asyncrpc.bench.report import write_plot

    doc = _doc()
    doc["meta"]["date"] = "2026-11-25"
    path = tmp_path / "bench.png"
    write_plot(doc, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
