"""``python -m asyncrpc.testing.chaos``: a chaos soak that proves no call is lost (layer L4).

Eight workers (``chaos_worker``) on 127.0.0.1, each behind a FaultProxy run here, so every
connection between two of them crosses one proxy. They run a mixed load (sync, future and
asyncio calls, ``remote()`` with forks passed on, distributed autograd steps with a
``DistributedOptimizer``) while a seeded scheduler drops, delays, black-holes and cuts
connections and stops workers with SIGSTOP. At the end the two halves of every worker's
ledger are audited together (see ``audit``), RRef counts must be zero everywhere and fds
and threads back at their baseline. Exit status 0 only if every figure holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrpc.testing.faultproxy import FaultProxy
from asyncrpc.testing.launcher import free_port

__all__ = ["audit", "main", "soak"]

_ROOT = Path(__file__).resolve().parents[2]
_RSS_SLACK_KIB = 96 * 1024  # allocator noise and torch's caches; a per-call leak is far more


class Worker:
    """A chaos worker we started: its stdout lines arrive through a reader thread."""

    def __init__(self, rank: int, cmd: list[str], log_path: Path) -> None:
        self.rank = rank
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=env, cwd=_ROOT,
            )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.progress = 0  # operations started, from the worker's PROGRESS lines
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # ends at the process's exit
            if line.startswith("PROGRESS "):
                self.progress = int(line.split()[1])
            else:
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def send(self, word: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()

    def expect(self, word: str, timeout: float) -> Any:
        """The data of the next ``word`` line; RuntimeError (with the log) if none comes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"c{self.rank}: no {word} within {timeout:.0f} s\n{self.log()}")
            if line.startswith(word + " "):
                return json.loads(line[len(word) + 1 :])

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Kill the process if it still runs (by its PID), reap it, close its pipes."""
        self.signal(signal.SIGCONT)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10.0)
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        with contextlib.suppress(OSError):  # a pipe the dead process broke
            self.process.stdin.close()
        self._reader.join(10.0)  # it ends at the pipe's EOF
        self.process.stdout.close()


# -- the fault scheduler ------------------------------------------------------------------


@dataclass
class Scheduler:
    """Injects one fault at a time, chosen by a seeded generator, until told to stop."""

    proxies: list[FaultProxy]
    workers: list[Worker]
    rng: random.Random
    counts: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        faults: list[Callable[[int], None]] = [
            self.drop, self.delay, self.blackhole, self.truncate, self.sigstop,
        ]  # fmt: skip
        while not self.stop.wait(self.rng.uniform(0.2, 1.5)):  # ends when stop is set
            fault = self.rng.choice(faults)
            self.counts[fault.__name__] = self.counts.get(fault.__name__, 0) + 1
            fault(self.rng.randrange(len(self.proxies)))

    def _hold(self, low: float, high: float) -> None:
        self.stop.wait(self.rng.uniform(low, high))

    def drop(self, i: int) -> None:
        """Reset every connection to worker i."""
        self.proxies[i].drop()
        self.proxies[i].heal()

    def delay(self, i: int) -> None:
        self.proxies[i].delay(self.rng.uniform(0.01, 0.3))
        self._hold(0.5, 3.0)
        self.proxies[i].heal()

    def blackhole(self, i: int) -> None:
        """A link that swallows everything for a while, then resets: bytes a black hole
        swallowed are gone, so the connection cannot carry on (TCP would not lose them)."""
        self.proxies[i].blackhole()
        self._hold(0.3, 3.0)
        self.proxies[i].drop()
        self.proxies[i].heal()

    def truncate(self, i: int) -> None:
        """The next connection to carry enough bytes towards worker i is cut mid-frame."""
        self.proxies[i].truncate(self.rng.randrange(1, 200_000))
        self._hold(0.3, 1.5)
        self.proxies[i].heal()

    def sigstop(self, i: int) -> None:
        """A hung worker: stopped for less than the heartbeat limit (1.25 s of silence
        before its process is probed, by default), then continued."""
        self.workers[i].signal(signal.SIGSTOP)
        try:
            self._hold(0.2, 1.0)
        finally:
            self.workers[i].signal(signal.SIGCONT)

    def heal_all(self) -> None:
        for proxy, worker in zip(self.proxies, self.workers, strict=True):
            proxy.heal()
            worker.signal(signal.SIGCONT)


# -- the audit --------------------------------------------------------------------------------


def audit(ledgers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Check both halves of every worker's ledger together.

    Returns:
        ``ops`` (operations started), ``outcomes`` (by outcome), and the failure counts:
        ``lost`` (never ended, or succeeded without a step having run), ``duplicated``
        (ended twice, or a step ran twice), ``wrong`` (a result not its own), ``untyped``
        (an error outside the runtime's tree), ``hung`` (outlived its bound), ``phantom``
        (a step ran for an operation nobody started).
    """
    names = [f"c{r}" for r in range(len(ledgers))]
    runs = {name: ledger["callee"] for name, ledger in zip(names, ledgers, strict=True)}
    ops = {key: op for ledger in ledgers for key, op in ledger["caller"].items()}
    figures = {"ops": len(ops), "lost": 0, "duplicated": 0, "wrong": 0, "untyped": 0,
               "hung": 0, "phantom": 0}  # fmt: skip
    outcomes: dict[str, int] = {}
    for _kind, outcome, ended, steps in ops.values():
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        figures["lost"] += ended == 0
        figures["duplicated"] += ended > 1
        figures["wrong"] += outcome == "wrong"
        figures["untyped"] += outcome.startswith("untyped:")
        figures["hung"] += outcome == "hung"
        if outcome == "ok":
            for step in steps:
                worker, _, run = step.partition("|")
                figures["lost"] += runs[worker].get(run, 0) == 0
    for counts in runs.values():
        for run, n in counts.items():
            figures["duplicated"] += n > 1
            figures["phantom"] += run.partition("/")[0] not in ops
    return {**figures, "outcomes": dict(sorted(outcomes.items()))}


# -- the soak -----------------------------------------------------------------------------


def _spawn(
    args: argparse.Namespace, work: Path, init: str
) -> tuple[list[FaultProxy], list[Worker]]:
    proxies, workers = [], []
    for rank in range(args.workers):
        listen = free_port()
        proxy = FaultProxy(listen)
        proxies.append(proxy)
        cmd = [sys.executable, "-m", "asyncrpc.testing.chaos_worker", "--rank", str(rank),
               "--world-size", str(args.workers), "--init-method", init,
               "--listen-port", str(listen), "--advertise-port", str(proxy.port),
               "--seed", str(args.seed), "--out", str(work / f"c{rank}.json")]  # fmt: skip
        workers.append(Worker(rank, cmd, work / f"c{rank}.log"))
    return proxies, workers


def _tell(workers: list[Worker], word: str) -> None:
    for worker in workers:
        worker.send(word)


def _all(workers: list[Worker], word: str, answer: str, timeout: float) -> list[Any]:
    """Tell every worker ``word`` (none if empty); wait for each one's ``answer``."""
    if word:
        _tell(workers, word)
    deadline = time.monotonic() + timeout
    return [w.expect(answer, max(1.0, deadline - time.monotonic())) for w in workers]


def _load_for(args: argparse.Namespace, workers: list[Worker], started: float) -> None:
    """Until ``args.duration`` has passed, or (with ``args.calls``) that many operations
    have started in all, whichever comes first."""
    deadline = started + args.duration
    while time.monotonic() < deadline:  # bounded by the deadline
        if args.calls and sum(w.progress for w in workers) >= args.calls:
            return
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _drive(
    args: argparse.Namespace, proxies: list[FaultProxy], workers: list[Worker]
) -> dict[str, Any]:
    _all(workers, "", "READY", args.start_timeout)
    scheduler = Scheduler(proxies, workers, random.Random(args.seed))
    faults = threading.Thread(target=scheduler.run, name="chaos-faults", daemon=True)
    started = time.monotonic()
    _tell(workers, "GO")
    if args.faults:
        faults.start()
    _load_for(args, workers, started)
    scheduler.stop.set()
    if faults.is_alive():
        faults.join(10.0)
    scheduler.heal_all()
    load_s = time.monotonic() - started
    done = _all(workers, "STOP", "DONE", 120.0)
    _all(workers, "RELEASE", "RELEASED", 60.0)
    checked = _all(workers, "CHECK", "CHECKED", 150.0)
    ledgers = [json.loads(Path(args.work / f"c{w.rank}.json").read_text()) for w in workers]
    _tell(workers, "EXIT")
    codes = [w.process.wait(90.0) for w in workers]
    return {"seed": args.seed, "workers": args.workers, "load_s": round(load_s, 1),
            "faults": scheduler.counts, **audit(ledgers),
            "stuck_lanes": sum(d["stuck_lanes"] for d in done),
            "false_losses": sum(d["false_losses"] for d in done),
            "liveness_probes": sum(d["liveness_probes"] for d in done),
            "workers_state": checked, "exit_codes": codes}  # fmt: skip


def _verdict(report: dict[str, Any]) -> list[str]:
    """What failed, in words; empty when every figure holds."""
    bad = [f"{k} {report[k]}" for k in ("lost", "duplicated", "wrong", "untyped", "hung",
                                         "phantom", "stuck_lanes", "false_losses")
           if report[k]]  # fmt: skip
    for rank, state in enumerate(report["workers_state"]):
        base, end = state["baseline"], state["end"]
        if not state["rrefs_zero"]:
            bad.append(f"c{rank} RRef counts {state['rref_counts']}")
            for kind, lines in state.get("rref_entries", {}).items():
                bad.extend(f"c{rank} {kind}: {line}" for line in lines)
        if not state["back"]:
            bad.append(f"c{rank} fds/threads {base} -> {end}")
        if end["rss_kib"] > base["rss_kib"] * 1.25 + _RSS_SLACK_KIB:
            bad.append(f"c{rank} RSS {base['rss_kib']} -> {end['rss_kib']} KiB")
    if report["exit_codes"] != [0] * report["workers"]:
        bad.append(f"exit codes {report['exit_codes']}")
    return bad


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run one soak as ``args`` says; return the report (``failures`` empty if it held)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    proxies, workers = _spawn(args, args.work, init)
    try:
        report = _drive(args, proxies, workers)
    finally:
        for worker in workers:  # only the PIDs we started
            worker.close()
        for proxy in proxies:
            proxy.close()
    report["failures"] = _verdict(report)
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"chaos soak: {report['workers']} workers, seed {report['seed']}, "
          f"{report['load_s']} s of load, faults {report['faults']}")  # fmt: skip
    print(f"  operations {report['ops']}: {report['outcomes']}")
    print(
        "  lost {lost}, duplicated {duplicated}, wrong {wrong}, untyped {untyped}, "
        "hung {hung}, phantom {phantom}, stuck lanes {stuck_lanes}, "
        "false losses {false_losses} (liveness probes {liveness_probes})".format(**report)
    )
    for rank, state in enumerate(report["workers_state"]):
        base, end = state["baseline"], state["end"]
        print(f"  c{rank}: rrefs {state['rref_counts']}, fds {base['fds']}->{end['fds']}, "
              f"threads {base['threads']}->{end['threads']}, "
              f"RSS {base['rss_kib'] // 1024}->{end['rss_kib'] // 1024} MiB")  # fmt: skip
    print("  PASS" if not report["failures"] else f"  FAIL: {report['failures']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--calls",
        type=int,
        default=0,
        help="stop once this many operations started (still bounded by --duration)",
    )
    parser.add_argument(
        "--no-faults",
        dest="faults",
        action="store_false",
        help="the load and the ledger alone: a plain soak",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--work", type=Path, default=None, help="logs and ledgers (a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrpc-chaos-") as tmp:
        args.work = args.work or Path(tmp)
        args.work.mkdir(parents=True, exist_ok=True)
        report = soak(args)
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
