"""Why shutdown barriers poll instead of a store ``wait`` (docs/scale.md, issue 38).

    .venv/bin/python -m bench.store_wait_exit [--runs 3]

A child process starts a thread that calls one TCPStore request and then exits at once;
the request returns while the interpreter is finalizing. With ``wait`` (timing out after
50 ms) the child aborts: "terminate called without an active exception", exit code -6 on
Python 3.11 (the interpreter unwinds the thread through torch's C++ code). With ``check``
(after a 50 ms sleep) it exits 0. A barrier's wait runs on an executor thread, so a wait
left running when a worker exits aborts that worker.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import threading
import time


def _child(port: int, request: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)

    def call() -> None:
        try:
            if request == "wait":
                store.wait(["never-set"], datetime.timedelta(seconds=0.05))
            else:
                time.sleep(0.05)
                store.check(["never-set"])
        except Exception:  # the timeout: what matters is when it returns
            pass

    threading.Thread(target=call, daemon=True).start()
    sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), args.child[1])
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for request in ("wait", "check"):
        codes = []
        for _ in range(args.runs):
            child = [sys.executable, "-m", "bench.store_wait_exit", "--child"]
            done = subprocess.run(
                [*child, str(server.port), request],
                check=False, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            codes.append(done.returncode)
        print(f"{request}: exit codes {codes}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
