"""Start-up mistakes, one member per process (test layer): ``python -m
tests.integration.init_scenarios startup [options]`` joins a group, optionally with a fault
injected around the rendezvous, and prints one ``RESULT {json}`` line (see ``scenarios``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence

import asyncrpc
from asyncrpc.runtime.group import rendezvous
from tests.integration import remote_fns as fns
from tests.integration.scenarios import Observations, _attempt, _report


def _claim_size_last() -> None:
    """Fault injection: this member compares world sizes only once another member has
    recorded its own (waits for that key, bounded), so it is the one to see a difference."""
    original = rendezvous.StoreGroup.claim_size

    def late(group: rendezvous.StoreGroup) -> None:
        deadline = time.monotonic() + 20.0
        while not group.store.check(["asyncrpc/world_size"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        original(group)

    rendezvous.StoreGroup.claim_size = late  # type: ignore[method-assign]


def startup(args: argparse.Namespace) -> int:
    """Join as ``--name``/``--rank``; then call each ``--call`` peer and shut down.

    ``--exit-at-once``: a failed init ends the process at once (``os._exit``, no teardown);
    ``--exit-after-init``: a successful one too (the store host leaving right after start).
    Exits 1 when init_rpc fails, 0 otherwise.
    """
    if args.claim_last:
        _claim_size_last()
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        shutdown_timeout=args.rpc_timeout,
    )
    init = _attempt(lambda: asyncrpc.init_rpc(args.name, None, args.rank, args.world_size, options))
    obs: Observations = {"init": init}
    if init["error"] is not None or args.exit_after_init:
        _report(obs)
        code = 1 if init["error"] is not None else 0
        if args.exit_at_once or args.exit_after_init:
            sys.stdout.flush()
            os._exit(code)  # no teardown: the store (rank 0's) goes at once
        return code
    obs["calls"] = {
        peer: _attempt(functools.partial(asyncrpc.rpc_sync, peer, fns.pid)) for peer in args.call
    }
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=args.rpc_timeout))
    _report(obs)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["startup"])
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--rpc-timeout", type=float, default=10.0)
    parser.add_argument("--call", action="append", default=[])
    parser.add_argument("--claim-last", action="store_true")
    parser.add_argument("--exit-at-once", action="store_true")
    parser.add_argument("--exit-after-init", action="store_true")
    return startup(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
