"""The orchestrator: interleaved rounds, each on freshly started processes, and the plain program.

Part of ``asyncrpc.bench``. For each round, each system's processes are started anew
(``fresh``, the default: one start's scheduling luck must not decide a whole run, see
bench/RESULTS.md), then for each workload each system runs its items in turn, each item
warmed up right before it is timed, the order rotating between rounds so slow machine noise
lands on every system. While one system is measured the others are frozen (SIGSTOP),
unless ``freeze`` is off. After the harness's processes stop, each library's plain program
runs in its own fresh processes. CPU use of every system is sampled from /proc.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrpc.bench.config import PLAIN_ROWS, POLLED, BenchConfig, items_for
from asyncrpc.bench.plain import PlainError, run_plain
from asyncrpc.bench.procs import ChildError, SystemGroup, start_group
from asyncrpc.bench.progress import Progress

__all__ = ["RunResult", "run_bench", "torch_rpc_unavailable"]

# Per item: what a child answered ({"stats": ...}, {"unavailable": ...} or {"error": ...}).
Outcome = dict[str, Any]


@dataclass
class RunResult:
    """Everything measured in one run, per system, workload and item, one entry per round."""

    config: BenchConfig
    status: dict[str, str] = field(default_factory=dict)  # system -> "ok" or why not
    raw: dict[str, dict[str, dict[str, list[Outcome]]]] = field(default_factory=dict)
    cpu_busy: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    cpu_idle: dict[str, float | None] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)  # system -> process starts
    wall_s: float = 0.0


def torch_rpc_unavailable() -> str | None:
    """Why ``torch.distributed.rpc`` cannot run here, or None when it can."""
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return f"torch.distributed cannot be imported ({exc})"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    try:
        from torch.distributed import rpc
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return f"torch.distributed.rpc cannot be imported ({exc})"
    if not rpc.is_available():
        return "this torch build has no torch.distributed.rpc (TensorPipe)"
    return None


def _merge_ps(answers: list[dict[str, Outcome]]) -> dict[str, Outcome]:
    # The parameter-server figure is the sum of every trainer's updates/s.
    merged: dict[str, Outcome] = {}
    for key in answers[0]:
        outcomes = [a[key] for a in answers]
        bad = next((o for o in outcomes if "stats" not in o), None)
        if bad is not None:
            merged[key] = bad
            continue
        stats = [o["stats"] for o in outcomes]
        rate = sum(s["updates"] / s["elapsed_s"] for s in stats)
        merged[key] = {"stats": {"updates_per_s": rate, "trainers": stats}}
    return merged


class _Orchestrator:
    def __init__(self, config: BenchConfig, progress: Progress, log_dir: Path) -> None:
        self.config = config
        self.progress = progress
        self.log_dir = log_dir
        self.groups: dict[str, SystemGroup] = {}
        self.result = RunResult(config)
        self.harness = [w for w in config.workloads if w != "plain"]

    def start(self) -> None:
        """Start every system still in the run that has no processes now."""
        # All systems start at once (importing torch dominates); each is frozen as soon
        # as it is ready so that none disturbs another.
        systems = [
            s for s in self.config.systems
            if self.result.status.get(s, "ok") == "ok" and s not in self.groups
        ]  # fmt: skip
        if not self.harness or not systems:
            # The plain program starts its own processes: it needs no harness process.
            self.result.status.update(dict.fromkeys(systems, "ok"))
            return
        self.progress.step(f"starting {', '.join(systems)}")
        with concurrent.futures.ThreadPoolExecutor(max(1, len(systems))) as pool:
            started = {s: pool.submit(self._start_one, s) for s in systems}
            for system, future in started.items():
                try:
                    self.groups[system] = future.result()
                except ChildError as exc:
                    self._drop(system, f"failed to start: {exc}")
                    continue
                self.result.status[system] = "ok"
                self.result.starts[system] = self.result.starts.get(system, 0) + 1

    def _start_one(self, system: str) -> SystemGroup:
        group = start_group(system, self.config, self.log_dir)
        if self.config.freeze:
            group.freeze()  # at once: idle TensorPipe would slow the others' start
        return group

    def _drop(self, system: str, reason: str) -> None:
        self.result.status[system] = reason
        self.progress.note(f"asyncrpc.bench: {system}: {reason}; going on without it")
        group = self.groups.pop(system, None)
        if group is not None:
            group.close(timeout=5.0)

    def measure_idle(self) -> None:
        for system, group in list(self.groups.items()):
            self.progress.step(f"idle CPU of {system}")
            group.thaw()
            time.sleep(0.2)
            before, t0 = group.cpu_seconds(), time.monotonic()
            time.sleep(self.config.idle_seconds)
            after, t1 = group.cpu_seconds(), time.monotonic()
            if self.config.freeze:
                group.freeze()
            idle = None if before is None or after is None else (after - before) / (t1 - t0)
            self.result.cpu_idle[system] = idle

    def run_round(self, round_no: int) -> None:
        """One round: every harness workload on every system (the order rotating between
        rounds), then the plain program of each system. With fresh processes (the default)
        the harness's processes are started for this round and stopped before the plain
        program runs."""
        self.start()
        if round_no == 0:
            self.measure_idle()
        systems = [s for s in self.config.systems if self.result.status.get(s) == "ok"]
        if not systems:
            return
        order = systems[round_no % len(systems) :] + systems[: round_no % len(systems)]
        for workload in self.harness:
            for system in order:
                if system in self.groups:  # a failed system is dropped
                    self._run_one(round_no, workload, system)
        if self.config.fresh:
            self.close()
        if "plain" in self.config.workloads:
            for system in order:
                if items_for("plain", system, self.config):
                    self._run_plain(round_no, system)

    def _run_one(self, round_no: int, workload: str, system: str) -> None:
        items = items_for(workload, system, self.config)
        if not items:
            return
        name = f"round {round_no + 1}/{self.config.rounds}"
        self.progress.step(f"{name} {workload} {system}")
        duration, warmup = self._durations(workload)
        timeout = len(items) * (warmup + duration + 30.0) + 60.0
        group = self.groups[system]
        group.thaw()
        cpu0, t0 = group.cpu_seconds(), time.monotonic()
        try:
            answers = group.run(
                workload, [i.to_json() for i in items], duration, timeout, warmup=warmup
            )
        except ChildError as exc:
            self._drop(system, f"failed during {name} of {workload}: {exc}")
            return
        cpu1, t1 = group.cpu_seconds(), time.monotonic()
        if self.config.freeze:
            group.freeze()
        self._record(workload, system, answers, cpu0, cpu1, t1 - t0)

    def _run_plain(self, round_no: int, system: str) -> None:
        # A user's own program in fresh processes; it warms itself up. Any harness process
        # still alive (reused processes) is frozen meanwhile when freezing is on.
        self.progress.step(f"round {round_no + 1}/{self.config.rounds} plain {system}")
        per_item = self.result.raw.setdefault(system, {}).setdefault("plain", {})
        try:
            rows = run_plain(system, self.config.plain_calls, self.log_dir, timeout=300.0)
        except PlainError as exc:
            self.progress.note(f"asyncrpc.bench: {system} plain: {exc}")
            for key, _ in PLAIN_ROWS:
                per_item.setdefault(key, []).append({"error": str(exc)})
            return
        for key, stats in rows.items():
            per_item.setdefault(key, []).append({"stats": stats})
        poll = self.config.plain_busy_poll_us
        if system == "asyncrpc" and poll:
            self._run_plain_polled(round_no, poll, per_item)

    def _run_plain_polled(self, round_no: int, poll: int, per_item: dict[str, Any]) -> None:
        """asyncrpc's plain program again, its lanes polling ``poll`` µs (rows of its own)."""
        self.progress.step(f"round {round_no + 1}/{self.config.rounds} plain asyncrpc, polling")
        try:
            rows = run_plain("asyncrpc", self.config.plain_calls, self.log_dir, 300.0, poll)
        except PlainError as exc:
            self.progress.note(f"asyncrpc.bench: asyncrpc plain, polling: {exc}")
            for key, _ in PLAIN_ROWS:
                per_item.setdefault(key + POLLED, []).append({"error": str(exc)})
            return
        for key, stats in rows.items():
            per_item.setdefault(key + POLLED, []).append({"stats": stats})

    def _durations(self, workload: str) -> tuple[float, float]:
        """Seconds each item is timed, and seconds it is warmed up just before."""
        if workload == "ps":
            return self.config.ps_duration, min(self.config.ps_duration, 0.5)
        return self.config.duration, self.config.warmup

    def _record(
        self,
        workload: str,
        system: str,
        answers: list[dict[str, Outcome]],
        cpu0: float | None,
        cpu1: float | None,
        wall: float,
    ) -> None:
        merged = _merge_ps(answers) if workload == "ps" else answers[0]
        per_item = self.result.raw.setdefault(system, {}).setdefault(workload, {})
        for key, outcome in merged.items():
            per_item.setdefault(key, []).append(outcome)
            if "error" in outcome:
                self.progress.note(f"asyncrpc.bench: {system} {workload} {key}: {outcome['error']}")
        if cpu0 is not None and cpu1 is not None:
            busy = self.result.cpu_busy.setdefault(system, {}).setdefault(workload, [])
            busy.append((cpu1 - cpu0) / wall)

    def close(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.groups))) as pool:
            for group in self.groups.values():
                pool.submit(group.close, 20.0)
        self.groups.clear()


def _total_steps(config: BenchConfig) -> int:
    runs = sum(1 for w in config.workloads for s in config.systems if items_for(w, s, config))
    harness = any(w != "plain" for w in config.workloads)
    starts = (config.rounds if config.fresh else 1) if harness else 0
    return 1 + starts + (len(config.systems) if harness else 0) + config.rounds * runs


def run_bench(config: BenchConfig, *, progress: bool = True) -> RunResult:
    """Run the whole benchmark and return what was measured.

    Systems that cannot run (torch without RPC, a process that fails) are reported in
    ``RunResult.status`` and left out; every process started is stopped before returning.
    """
    bar = Progress(_total_steps(config), enabled=progress)
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="asyncrpc-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    orchestrator = _Orchestrator(config, bar, log_dir)
    reason = torch_rpc_unavailable()
    if reason is not None:
        for system in config.systems:
            if system.startswith("torch"):
                orchestrator._drop(system, f"unavailable: {reason}")
    start = time.monotonic()
    try:
        for round_no in range(config.rounds):
            orchestrator.run_round(round_no)
    finally:
        bar.step("stopping processes")
        orchestrator.close()
        bar.close()
    orchestrator.result.wall_s = time.monotonic() - start
    if config.log_dir is None and all(s == "ok" for s in orchestrator.result.status.values()):
        shutil.rmtree(log_dir, ignore_errors=True)
    return orchestrator.result
