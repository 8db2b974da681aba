"""Run torch's RPC test suites against asyncrpc and judge them against the expected failures.

Usage: ``python -m tests.conformance.run [--suites core|extended|all|NAME,...] [--ci]
[-k TEXT] [--impl asyncrpc|torch] [--json PATH]``. Prints ``N passed, N failed, N skipped``
and writes a JSON report. The verdict is exact: a failure not listed in
``expected_failures.txt`` and a listed test that passes both fail the run (exit status 1),
so the list always says what asyncrpc does not do, and why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import unittest
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXPECTED_FILE = HERE / "expected_failures.txt"
CI_FILE = HERE / "ci_subset.txt"


@dataclass
class Outcome:
    test: str  # Suite.test_name
    outcome: str = "passed"  # passed | failed | skipped
    seconds: float = 0.0
    error: str = ""
    expected_failure: str = ""  # the reason, when listed
    verdict: str = "ok"  # ok | new failure | new pass


@dataclass
class Report:
    impl: str
    torch: str
    python: str
    suites: list[str]
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    tests: list[Outcome] = field(default_factory=list)


def read_list(path: Path) -> dict[str, str]:
    """``Suite.test  reason`` lines (``#`` comments, blank lines ignored) as a dict."""
    entries: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        name, _, reason = line.partition(" ")
        if path == EXPECTED_FILE and not reason.strip():
            raise SystemExit(f"{path.name}:{number}: {name} has no reason")
        if name in entries:
            raise SystemExit(f"{path.name}:{number}: {name} is listed twice")
        entries[name] = reason.strip()
    return entries


def first_error(text: str) -> str:
    """The last ``SomethingError: message`` line of a (worker's) traceback."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pattern = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt|Timeout)\b.*")
    for ln in reversed(lines):
        if pattern.match(ln) and not ln.startswith("Exception raised from"):
            return ln[:400]
    return lines[-1][:400] if lines else ""


class _Result(unittest.TestResult):
    def __init__(self, outcomes: list[Outcome], verbose: bool) -> None:
        super().__init__()
        self.outcomes = outcomes
        self.verbose = verbose
        self._start = 0.0

    def _name(self, test: unittest.TestCase) -> str:
        return f"{type(test).__name__}.{test._testMethodName}"

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._start = time.monotonic()

    def _add(self, test: unittest.TestCase, outcome: str, error: str = "") -> None:
        record = Outcome(self._name(test), outcome, time.monotonic() - self._start, error)
        self.outcomes.append(record)
        mark = {"passed": ".", "failed": "F", "skipped": "s"}[outcome]
        if self.verbose:
            print(f"{mark} {record.test} ({record.seconds:.1f} s) {error}", flush=True)
        else:
            print(mark, end="", flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._add(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._add(test, "failed", first_error(self._exc_info_to_string(err, test)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._add(test, "failed", first_error(self._exc_info_to_string(err, test)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._add(test, "skipped", reason[:200])

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._add(test, "passed")  # torch's own expectedFailure: the test did what torch says

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._add(test, "failed", "unexpected success of a torch expectedFailure")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.run", description=__doc__)
    parser.add_argument("--suites", default="core", help="core, extended, all, or names")
    parser.add_argument("--ci", action="store_true", help="only the tests in ci_subset.txt")
    parser.add_argument(
        "-k", dest="match", action="append", help="only tests whose name contains this (repeat)"
    )
    parser.add_argument("--impl", choices=("asyncrpc", "torch"), default="asyncrpc")
    parser.add_argument("--json", default="conformance-report.json", help="report path")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    return parser.parse_args(argv)


NOT_RUN = "not run:"  # a reason starting so: the test hangs on asyncrpc and is not started
EITHER = "either:"  # a reason starting so: the outcome depends on timing; both are accepted


def _select(
    args: argparse.Namespace, suite_mod: Any, expected: dict[str, str]
) -> tuple[list[str], unittest.TestSuite, list[str]]:
    if args.suites == "core":
        names = list(suite_mod.CORE_NAMES)
    elif args.suites == "extended":
        names = list(suite_mod.EXTENDED_NAMES)
    elif args.suites == "all":
        names = list(suite_mod.SUITES)
    else:
        names = args.suites.split(",")
    ci = read_list(CI_FILE) if args.ci else None
    loader = unittest.TestLoader()
    selected = unittest.TestSuite()
    not_run: list[str] = []
    for name in names:
        cls = suite_mod.SUITES[name]
        for method in loader.getTestCaseNames(cls):
            full = f"{name}.{method}"
            if ci is not None and full not in ci:
                continue
            if args.match and not any(text in full for text in args.match):
                continue
            if expected.get(full, "").startswith(NOT_RUN):
                not_run.append(full)
                continue
            selected.addTest(cls(method))
    return names, selected, not_run


def _judge(report: Report, expected: dict[str, str]) -> None:
    for record in report.tests:
        reason = expected.get(record.test, "")
        record.expected_failure = reason
        if record.outcome == "failed" and not reason:
            record.verdict = "new failure"
        elif record.outcome == "passed" and reason and not reason.startswith(EITHER):
            record.verdict = "new pass"
    counts = {"passed": 0, "failed": 0, "skipped": 0, "expected failures": 0}
    counts.update({"new failures": 0, "new passes": 0})
    for record in report.tests:
        counts[record.outcome] += 1
        counts["expected failures"] += record.outcome == "failed" and bool(record.expected_failure)
        counts["new failures"] += record.verdict == "new failure"
        counts["new passes"] += record.verdict == "new pass"
    report.counts = counts


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ["ASYNCRPC_CONFORMANCE_IMPL"] = args.impl
    # Workers' output (torch logs every failing worker's traceback) goes to the log file.
    from tests.conformance import suite as suite_mod

    expected = read_list(EXPECTED_FILE) if args.impl == "asyncrpc" else {}
    names, selected, not_run = _select(args, suite_mod, expected)
    import torch

    report = Report(args.impl, torch.__version__, platform.python_version(), names)
    print(f"{selected.countTestCases()} tests of {', '.join(names)} on {args.impl}", flush=True)
    start = time.monotonic()
    result = _Result(report.tests, args.verbose)
    selected.run(result)
    for name in not_run:
        report.tests.append(Outcome(name, "failed", error="not run (see expected_failures.txt)"))
    report.seconds = round(time.monotonic() - start, 1)
    print()
    _judge(report, expected)
    for record in report.tests:
        if record.verdict != "ok":
            print(f"{record.verdict}: {record.test}: {record.error or record.expected_failure}")
    c = report.counts
    print(
        f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped in "
        f"{report.seconds:.0f} s ({args.impl}, torch {report.torch}); "
        f"{c['expected failures']} expected failures, {c['new failures']} new failures, "
        f"{c['new passes']} new passes"
    )
    data = asdict(report)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(f"report: {args.json}")
    return 1 if c["new failures"] or c["new passes"] else 0


if __name__ == "__main__":
    sys.exit(main())
