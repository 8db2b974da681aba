"""Figures of issue 15 (connections that heal, bounded waits, nested blocking calls).

    .venv/bin/python -m bench.heal_figures [--drops 100]    # from the repository root

Runs the driver scenarios of ``tests/scenarios/heal.py`` (the ones the tests
run), each with its own workers on 127.0.0.1, and prints the figures for bench/RESULTS.md:
the time from a dropped connection to the next successful call, the 100-drop soak (calls
ended typed or right, hung, leaks), an oversized send, shutdown with a never-contacted dead
peer, and nested blocking chains on 4 pool threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

_IMPORT = ["--import", "tests.integration.remote_fns"]


def run(name: str, workers: list[tuple[str, list[str]]], *args: str, log: Path) -> Any:
    init = f"tcp://127.0.0.1:{free_port()}"
    size = len(workers) + 1
    procs = [
        spawn_worker(n, r + 1, size, init, log_dir=log, rpc_timeout=20.0, shutdown_timeout=20.0,
                     extra_args=[*_IMPORT, *extra])
        for r, (n, extra) in enumerate(workers)
    ]  # fmt: skip
    driver = scenarios.start(name, "--init-method", init, "--world-size", str(size), *args)
    try:
        if name == "dead_peer":
            driver.wait_line("STARTED", 60.0)
            procs[0].kill()
            driver.send("KILLED")
        code, obs = driver.result(300.0)
    finally:
        driver.kill()
        stop_workers(procs, timeout=20.0)
    if code != 0:
        sys.exit(f"{name} failed:\n{driver.text()}")
    return obs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drops", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp)
        port, proxy = free_port(), free_port()
        extra = ["--listen-port", str(port), "--advertise-port", str(proxy),
                 "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
                 "--handshake-timeout", "1.5"]  # fmt: skip
        heal = run("heal", [("r1", extra)], "--port", str(port), "--proxy-port", str(proxy),
                   "--drops", str(args.drops), log=log)  # fmt: skip
        frames = run("frames", [("m1", ["--max-frame-size", str(1 << 20)])], log=log)
        dead = run("dead_peer", [("d1", []), ("d2", [])], log=log)
        four = ["--threads", "4"]
        capped = [*four, "--max-threads", "4"]
        started = time.monotonic()
        nested = run("nested", [("n1", four), ("n2", four), ("n3", capped), ("n4", capped)],
                     log=log)  # fmt: skip
        nested_s = time.monotonic() - started
    samples = [s["s"] for s in heal["next_call_after_drop"]]
    retried = sum(1 for s in heal["next_call_after_drop"] if s["attempts"] > 1)
    print(f"next call after a drop: median {statistics.median(samples) * 1e3:.1f} ms, "
          f"max {max(samples) * 1e3:.1f} ms over {len(samples)} drops "
          f"({retried} first attempts raced the drop and failed typed)")  # fmt: skip
    soak = heal["soak"]
    print(
        f"soak: {args.drops} drops in {heal['soak_s']:.1f} s; calls ok {soak['ok']}, "
        f"typed errors {soak['typed']} {soak['errors']}, hung {soak['hung']}, "
        f"wrong {soak['wrong']}; reconnects {heal['metrics']['reconnects']}"
    )
    print(
        f"  after: RRefs settled {heal['rrefs_settled']} ({heal['rref_debug']['r1']}), "
        f"refcount logs acked {heal['ref_log_acked']}, fds {heal['fds']}, "
        f"r1 pool threads {heal['r1_metrics']['thread_pool_threads']} "
        f"(blocked {heal['r1_metrics']['thread_pool_blocked']}), "
        f"shutdown error {heal['shutdown']['error']}"
    )
    print(
        f"oversized send: {frames['send_big']['error']['type']} in "
        f"{frames['send_big']['elapsed'] * 1e3:.2f} ms, bytes written {frames['bytes_written']}, "
        f"connections lost {frames['connections_lost']}, then 0.5 MiB ok: "
        f"{frames['send_half']['value'] == 1 << 19}; oversized reply: "
        f"{frames['reply_big']['error']['type']}"
    )
    print(
        f"shutdown with a never-contacted dead peer: {dead['shutdown']['elapsed']:.2f} s, "
        f"{dead['shutdown']['error']['type']}: {dead['shutdown']['error']['message']}"
    )
    print(
        f"nested on 4 threads: 1x32 -> {nested['deep']['value']} in "
        f"{nested['deep']['elapsed'] * 1e3:.0f} ms; 8x8 -> {nested['eight']['value']} in "
        f"{nested['eight']['elapsed'] * 1e3:.0f} ms; cap 4 with depth 16 -> "
        f"{nested['capped']['error']['type']} in {nested['capped']['elapsed'] * 1e3:.0f} ms "
        f"(scenario {nested_s:.1f} s)"
    )


if __name__ == "__main__":
    main()
