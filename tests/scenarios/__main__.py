"""The one entry point (test layer): ``python -m tests.scenarios NAME [options]``.

Imports every topic module (each registers its scenarios), parses the command line with
the one parser, runs the scenario and exits with its code.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from tests.scenarios import (  # noqa: F401 (imported to register their scenarios)
    auth,
    autograd,
    cuda,
    ddp,
    duplex,
    dynamic,
    faults,
    heal,
    hosts,
    init,
    jobs,
    lanes,
    rref,
    shm,
    stream,
)
from tests.scenarios.registry import SCENARIOS, parse


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    code = SCENARIOS[args.scenario].run(args)
    print(f"scenario {args.scenario} took {time.monotonic() - started:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
