"""How asyncrpc's cost grows with the number of workers on one machine (issue 25).

    .venv/bin/python -m bench.size [--sizes 8 16 32 64] [--json out.json]   # repository root

For each size N it starts N workers on 127.0.0.1 (rank 0 drives), lets every worker call
every other once, all at the same time, reads each worker's memory and file descriptors,
and shuts the group down gracefully. It prints one row per size:

- init: from the moment the last worker finished importing (torch's import takes most of
  a worker's start) until the last worker's ``init_rpc`` returned;
- all-to-all: N x (N - 1) calls, all pairs concurrently;
- shutdown: from the moment the last worker called ``shutdown()`` (a graceful shutdown
  waits for every member) until the last one returned;
- RSS and PSS per worker (PSS shares torch's pages among the workers that map them), open
  fds and threads per worker, all read after the all-to-all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "SIZE "


# -- one worker (``--worker``) --------------------------------------------------------------


def _drive(size: int) -> dict[str, Any]:
    import asyncrpc
    from asyncrpc.testing import chaos_fns
    from tests.integration import remote_fns as fns

    names = [f"s{r}" for r in range(size)]
    started = time.monotonic()
    answered = [asyncrpc.rpc_async(n, fns.call_everyone, args=(names,)) for n in names]
    answers = asyncrpc.wait_all(answered)
    calls_s = time.monotonic() - started
    prints = [asyncrpc.rpc_sync(n, chaos_fns.resources) for n in names]
    return {"all_pairs_ok": answers == [size - 1] * size, "calls_s": calls_s, "workers": prints}


def worker(rank: int, size: int, init_method: str) -> int:
    import asyncrpc

    imported = time.time()
    options = asyncrpc.RpcBackendOptions(
        init_method=init_method, rpc_timeout=300.0, shutdown_timeout=300.0, num_worker_threads=4
    )
    asyncrpc.init_rpc(f"s{rank}", rank=rank, world_size=size, rpc_backend_options=options)
    joined = time.time()
    report: dict[str, Any] = {"rank": rank, "imported": imported, "joined": joined}
    if rank == 0:
        report.update(_drive(size))
    # Nobody dies here: a peer this worker declared lost is a false loss (the heartbeat's
    # limits under the load of N workers on two cores).
    debug = asyncrpc.get_debug_info()
    report["lost_peers"], report["liveness_probes"] = debug["lost_peers"], debug["liveness_probes"]
    report["leaving"] = time.time()
    asyncrpc.shutdown(timeout=300.0)
    report["left"] = time.time()
    print(PREFIX + json.dumps(report), flush=True)
    return 0


# -- the launcher ---------------------------------------------------------------------------


def _free_port() -> int:
    from asyncrpc.testing import free_port

    return free_port()


def measure(size: int, log_dir: Path, timeout: float) -> dict[str, Any]:
    """Run one group of ``size`` workers; return its row."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    for rank in range(size):
        log = open(log_dir / f"s{size}-{rank}.log", "wb")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "bench.size", "--worker", str(rank), str(size), init]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=ROOT), log))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p, _ in procs]
    finally:
        for process, log in procs:  # only the PIDs we started
            if process.poll() is None:
                process.kill()
                process.wait(10)
            log.close()
    reports = []
    for rank in range(size):
        text = (log_dir / f"s{size}-{rank}.log").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(PREFIX)]
        if not lines:
            raise RuntimeError(f"s{rank} of {size} reported nothing:\n{text[-3000:]}")
        reports.append(json.loads(lines[-1][len(PREFIX) :]))
    return _row(size, reports, codes)


def _row(size: int, reports: list[dict[str, Any]], codes: list[int]) -> dict[str, Any]:
    driver = reports[0]
    prints = driver["workers"]

    def mean(key: str) -> float:
        return sum(p[key] for p in prints) / len(prints)

    return {
        "workers": size,
        "init_s": max(r["joined"] for r in reports) - max(r["imported"] for r in reports),
        "calls": size * (size - 1),
        "all_pairs_ok": driver["all_pairs_ok"],
        "calls_s": driver["calls_s"],
        # A graceful shutdown waits for every member: from the last one to call it.
        "shutdown_s": max(r["left"] for r in reports) - max(r["leaving"] for r in reports),
        "rss_mib": mean("rss_kib") / 1024,
        "pss_mib": mean("pss_kib") / 1024,
        "fds": mean("fds"),
        "fds_max": max(p["fds"] for p in prints),
        "threads": mean("os_threads"),
        "exit_codes_ok": codes == [0] * size,
        "false_losses": sum(len(r["lost_peers"]) for r in reports),
        "liveness_probes": sum(r["liveness_probes"] for r in reports),
    }


def _print(rows: list[dict[str, Any]]) -> None:
    print("| workers | init (s) | all-to-all calls | all-to-all (s) | shutdown (s) | RSS/worker "
          "(MiB) | PSS/worker (MiB) | fds/worker (max) | threads/worker | false losses "
          "(probes) | ok |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ok = r["all_pairs_ok"] and r["exit_codes_ok"] and not r["false_losses"]
        print(f"| {r['workers']} | {r['init_s']:.1f} | {r['calls']} | {r['calls_s']:.1f} "
              f"| {r['shutdown_s']:.1f} | {r['rss_mib']:.0f} | {r['pss_mib']:.0f} "
              f"| {r['fds']:.0f} ({r['fds_max']}) | {r['threads']:.0f} "
              f"| {r['false_losses']} ({r['liveness_probes']}) | {ok} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "SIZE", "INIT"), default=None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--timeout", type=float, default=900.0, help="per size")
    parser.add_argument("--json", default=None)
    parser.add_argument("--work", type=Path, default=None, help="keep the logs here")
    args = parser.parse_args(argv)
    if args.worker is not None:
        rank, size, init = args.worker
        return worker(int(rank), int(size), init)
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="asyncrpc-size-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for size in args.sizes:
            try:
                rows.append(measure(size, work, args.timeout))
            except RuntimeError as exc:  # one size failed: say so, measure the others
                failures.append(f"{size} workers: {exc}")
            print(f"{size} workers measured", file=sys.stderr, flush=True)
    _print(rows)
    for failure in failures:
        print(f"FAILED {failure[:3000]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    good = all(r["all_pairs_ok"] and r["exit_codes_ok"] and not r["false_losses"] for r in rows)
    return 0 if not failures and good else 1


if __name__ == "__main__":
    sys.exit(main())
