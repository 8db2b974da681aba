"""What a run says: each workload's ratio against torch, and whether the harness agrees with
a plain user program on the rows both measure.

Part of ``asyncrpc.bench``; pure functions over the summary document (``report.summarize``).
Every ratio is asyncrpc's figure divided by the other system's, and says which way it reads:
a *time* ratio (latency, CPU) below 1x means asyncrpc is faster or cheaper, a *rate* ratio
(calls/s, MB/s, steps/s) above 1x means asyncrpc is faster. Nothing is inverted.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from asyncrpc.bench.config import PLAIN_PAIRS, PLAIN_SYSTEMS

__all__ = ["MIN_TOLERANCE", "agree", "headline", "plain_checks", "ratio_kind", "reads", "spread"]

# The least difference counted as a disagreement: below it two figures agree whatever the
# rounds' spread. A round's p50 of a small call moves 10-30% between rounds on the 2-core VM.
MIN_TOLERANCE = 0.15


def ratio_kind(higher_is_better: bool) -> str:
    """``rate`` for figures where more is better, ``time`` for the others."""
    return "rate" if higher_is_better else "time"


def reads(kind: str) -> str:
    """How a ratio of ``kind`` reads, in the words every header and headline uses."""
    return "above 1x: asyncrpc faster" if kind == "rate" else "below 1x: asyncrpc faster"


def headline(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each workload's asyncrpc/torch ratio in this run: the median over its rows, with the
    lowest and highest, in the workload's own direction (``kind``), and how its rows fared
    against the plain program (``plain``: ``agrees``, ``disagrees`` or ``unchecked``)."""
    checks = doc.get("plain_checks") or plain_checks(doc)
    lines = []
    for name, summary in doc["workloads"].items():
        ratios = [r["ratios"].get("asyncrpc/torch") for r in summary["rows"]]
        ratios = [r for r in ratios if r]
        if not ratios:
            continue
        verdicts = [c["verdict"] for c in checks if c["workload"] == name]
        plain = "unchecked"
        if "disagrees" in verdicts:
            plain = "disagrees"
        elif "agrees" in verdicts:
            plain = "agrees"
        lines.append(
            {
                "workload": name,
                "kind": ratio_kind(summary["higher_is_better"]),
                "ratio": statistics.median(ratios),
                "lowest": min(ratios),
                "highest": max(ratios),
                "rows": len(ratios),
                "plain": plain,
                "plain_rows_checked": len(verdicts),
            }
        )
    return lines


def spread(values: list[float]) -> float:
    """How much a set of per-round figures differ among themselves: the middle half's
    highest / its lowest - 1 (with fewer than four rounds, the highest / the lowest - 1). One
    round stalled by the machine's other jobs moves neither this nor the median much."""
    ordered = sorted(v for v in values if v > 0)
    if len(ordered) < 2:
        return 0.0
    cut = len(ordered) // 4
    return ordered[len(ordered) - 1 - cut] / ordered[cut] - 1.0


def agree(harness: list[float], plain: list[float]) -> tuple[bool, float, float]:
    """Whether the medians of two sets of per-round figures agree within the spread.

    The tolerance is the larger of ``MIN_TOLERANCE`` and either set's ``spread``: a
    difference no larger than the rounds already differ among themselves is no disagreement.

    Returns:
        (agree, the harness median / the plain median - 1, the tolerance).
    """
    tolerance = max(MIN_TOLERANCE, spread(harness), spread(plain))
    diff = statistics.median(harness) / statistics.median(plain) - 1.0
    return abs(math.log1p(diff)) <= math.log1p(tolerance), diff, tolerance


def _rows_by_key(doc: dict[str, Any], workload: str) -> dict[str, dict[str, Any]]:
    rows = doc["workloads"].get(workload, {}).get("rows", [])
    # By asyncrpc's key: torch's repeat across rows (its def no-op answers several).
    return {row["keys"]["asyncrpc"]: row for row in rows if "asyncrpc" in row["keys"]}


def _per_round_ratios(row: dict[str, Any]) -> list[float]:
    mine = row["values"].get("asyncrpc", {}).get("rounds") or []
    theirs = row["values"].get("torch", {}).get("rounds") or []
    return [a / t for a, t in zip(mine, theirs, strict=False) if t]


def plain_checks(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """For each harness row that answers the same question as a plain program's row
    (``PLAIN_PAIRS``), both systems' figures side by side, the asyncrpc/torch ratio of each,
    and a verdict: ``agrees`` when each system's figure and the ratio agree (``agree``),
    ``disagrees`` when one does not, ``not measured`` when a side is missing."""
    plain = _rows_by_key(doc, "plain")
    checks = []
    for workload, key, plain_key in PLAIN_PAIRS:
        row = _rows_by_key(doc, workload).get(key)
        if row is None or plain_key not in plain:
            continue
        twin = plain[plain_key]
        check: dict[str, Any] = {"workload": workload, "label": row["label"], "plain": plain_key}
        sides: dict[str, dict[str, Any]] = {}
        for system in PLAIN_SYSTEMS:
            # A run without one of the libraries (--systems) has nothing to check.
            h = row["values"].get(system, {}).get("rounds")
            p = twin["values"].get(system, {}).get("rounds")
            if not h or not p:
                sides = {}
                break
            ok, diff, tolerance = agree(h, p)
            sides[system] = {"harness": statistics.median(h), "plain": statistics.median(p),
                             "diff": diff, "tolerance": tolerance, "agrees": ok}  # fmt: skip
        ratios = (_per_round_ratios(row), _per_round_ratios(twin))
        if not sides or not all(ratios):
            checks.append({**check, "verdict": "not measured"})
            continue
        # The ratios are compared round by round (each round runs both libraries in the same
        # minutes, so a slow minute moves both), and the figures kept are the ones compared:
        # the median of the rounds' ratios, which may differ from a table's ratio of medians.
        ok, diff, tolerance = agree(*ratios)
        check["systems"] = sides
        check["ratio"] = {"harness": statistics.median(ratios[0]),
                          "plain": statistics.median(ratios[1]),
                          "diff": diff, "tolerance": tolerance, "agrees": ok}  # fmt: skip
        every = ok and all(side["agrees"] for side in sides.values())
        checks.append({**check, "verdict": "agrees" if every else "disagrees"})
    return checks
