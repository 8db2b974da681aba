"""A torch-style job at a user's lengths (test layer): a parameter server that calls
``shutdown()`` right after joining and serves until everybody is done, and trainers that
call it for as long as they train. One worker per process; the test may SIGKILL a trainer.

``ps_job`` plays either role (``--role``). Its options default to a user's: no shutdown
bound (``--shutdown-timeout 0``), and dead workers reported as ``--lost-workers`` says.
"""

from __future__ import annotations

import argparse
import logging
import time
from functools import partial

import torch

import asyncrpc
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, options, report
from tests.scenarios.registry import option, scenario


class _Warnings(logging.Handler):
    """Keeps the text of asyncrpc's warnings, for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@scenario(
    "ps_job",
    option("--role", choices=("ps", "trainer"), required=True),
    option("--seconds", type=float, default=3.0, help="how long a trainer trains"),
    option("--lost-workers", default="warn"),
    shutdown_timeout=0.0,
)
def ps_job(args: argparse.Namespace) -> int:
    """A ps (rank 0) in ``shutdown()`` from the start, or a trainer calling it for a while.

    A trainer prints ``STARTED`` after its first call, then calls the ps every 20 ms (a
    tensor add, and ``to_here`` on an RRef it holds) for ``--seconds``, then shuts down.
    Both report their ``shutdown`` and the warnings asyncrpc logged.
    """
    warned = _Warnings()
    logging.getLogger("asyncrpc").addHandler(warned)
    opts = options(args, lost_workers=args.lost_workers)
    asyncrpc.init_rpc(
        args.name, rank=args.rank, world_size=args.world_size, rpc_backend_options=opts
    )
    obs: Observations = {"role": args.role}
    if args.role == "trainer":
        obs.update(_train(args.seconds))
    started = time.monotonic()
    obs["shutdown"] = attempt(asyncrpc.shutdown)
    obs["shutdown_took"] = time.monotonic() - started
    obs["warnings"] = warned.messages
    report(obs)
    return 0


def _train(seconds: float) -> Observations:
    """Call the ps until ``seconds`` have passed; count the calls and the failures."""
    held = asyncrpc.remote("ps", torch.ones, args=(4,))
    first = attempt(lambda: asyncrpc.rpc_sync("ps", torch.add, args=(torch.ones(4), 1)))
    print("STARTED", flush=True)
    calls, failures = 1, [] if first["error"] is None else [first["error"]]
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # bounded by --seconds
        step = attempt(partial(asyncrpc.rpc_sync, "ps", fns.add, args=(calls, 1)))
        value = attempt(held.to_here)
        failures += [r["error"] for r in (step, value) if r["error"] is not None]
        calls += 1
        time.sleep(0.02)
    return {"calls": calls, "failures": failures}
