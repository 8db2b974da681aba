"""``python -m tests.integration.prefork_probe``: reports what a started process sees
(test layer, for test_prefork.py).

Prints one JSON line (its name, argv, working directory, an environment variable, a random
number, its parent), then does what its arguments say: ``exit N``, ``raise``, ``sleep S``,
``thread`` (a non-daemon thread that prints after 0.3 s), ``atexit``, ``echo`` (stdin
lines back until EOF).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time


def main() -> int:
    print(json.dumps({
        "name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(),
        "probe": os.environ.get("PROBE"), "random": random.random(), "ppid": os.getppid(),
        "torch_loaded": "torch" in sys.modules,
    }), flush=True)  # fmt: skip
    args = sys.argv[1:]
    code = 0
    while args:
        what = args.pop(0)
        if what == "exit":
            code = int(args.pop(0))
        elif what == "raise":
            raise LookupError("the probe raised")
        elif what == "sleep":
            time.sleep(float(args.pop(0)))
        elif what == "thread":
            threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        elif what == "atexit":
            atexit.register(print, "atexit ran")
        elif what == "echo":
            for line in sys.stdin:
                print("echo " + line.rstrip("\n"), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
