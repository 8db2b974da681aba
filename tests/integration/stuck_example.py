"""A stand-in example that never ends, for the launcher's bounds (test_examples.py).

``python -m tests.integration.stuck_example --stuck main|worker --deadline S
--exit-grace G``: starts one worker through ``examples._launch.workers`` and prints
``WORKERS [pid]``. The worker (``--role worker``) waits for good. With ``--stuck main`` the
main process waits for good too, inside the block: only the deadline can stop the run.
With ``--stuck worker`` the main process is done at once, and the worker never exits.
"""

from __future__ import annotations

import argparse
import sys
import threading

from examples._launch import workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.stuck_example")
    parser.add_argument("--stuck", choices=("main", "worker"), default="main")
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--exit-grace", type=float, default=30.0)
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--init-method", default="")
    args = parser.parse_args(argv)
    forever = threading.Event()  # never set
    if args.role == "worker":
        forever.wait()
        return 0
    module = "tests.integration.stuck_example"  # __name__ is "__main__" here
    with workers(module, [1], 2, "", deadline=args.deadline, exit_grace=args.exit_grace) as procs:
        print(f"WORKERS {[p.pid for p in procs]}", flush=True)
        if args.stuck == "main":
            forever.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
