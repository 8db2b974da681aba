"""A member of a dynamic group, driven line by line from its stdin (test layer).

``python -m tests.scenarios dynamic_member --name N --rank R --init-method M`` joins
without a world size, prints ``JOINED``, then runs one command per input line and prints
``DONE <command> <json>`` for each; ``shutdown`` stops it and prints the ``RESULT`` line
that ``ScenarioProcess.result`` reads. The test decides who joins when and
who calls whom, so members that joined earlier and later meet in every order.

Commands: ``call NAME`` (``rpc_sync`` from this thread), ``acall NAME`` (``await call`` on
the agent's loop), ``remote NAME`` (an RRef owned by NAME, held here), ``pass NAME I``
(NAME fetches held RRef I through its own fork), ``fetch I`` (``to_here`` of held RRef I),
``drop I`` (let held RRef I go), ``infos``, ``watch`` (collect ``asyncrpc.membership()``
from now on), ``events N`` (the events collected, once N have come), ``shutdown``, and
``leave`` (``shutdown`` that first prints ``LEAVING`` once the shutdown has begun).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

import asyncrpc
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.ordering import in_function, until
from tests.scenarios.common import attempt, options, report
from tests.scenarios.registry import option, scenario

_held: list[asyncrpc.RRef[Any] | None] = []


def _on_loop(name: str) -> str:
    agent = current_agent()
    future = asyncio.run_coroutine_threadsafe(asyncrpc.call(name, fns.whoami), agent.loop.aio)
    return future.result(30.0)


def _remote(name: str) -> dict[str, Any]:
    rref = asyncrpc.remote(name, fns.add, (torch.ones(2), 1))
    _held.append(rref)
    return {"owner": rref.owner().name, "value": rref.to_here().tolist()}


def _pass(name: str, index: str) -> list[float]:
    value = asyncrpc.rpc_sync(name, fns.fetch, (_held[int(index)],), timeout=30.0)
    return list(value.tolist())


def _fetch(index: str) -> list[float]:
    rref = _held[int(index)]
    assert rref is not None
    return list(rref.to_here().tolist())


def _drop(index: str) -> None:
    _held[int(index)] = None
    gc.collect()  # the RRef's release is sent from its __del__


def _announce_leaving() -> None:
    """Print ``LEAVING`` from another thread once this one is inside ``asyncrpc.shutdown``
    (its stack shows it): the test then knows the member has begun to leave."""
    main = threading.get_ident()

    def in_shutdown(frame: FrameType) -> bool:
        return frame.f_code.co_filename.endswith(os.path.join("asyncrpc", "api.py"))

    def announce() -> None:
        until(lambda: in_function(main, "shutdown", in_shutdown), 30.0, "shutdown entered")
        print("LEAVING", flush=True)

    threading.Thread(target=announce, daemon=True).start()


_events: list[list[str]] = []


def _watch() -> None:
    """Collect ``asyncrpc.membership()`` on an event loop of the program's own (a thread)."""
    events = asyncrpc.membership()  # from now on

    async def collect() -> None:
        async for event in events:
            _events.append([event.kind, event.worker.name, event.evidence])

    threading.Thread(target=asyncio.run, args=(collect(),), daemon=True).start()


def _events_seen(count: str) -> list[list[str]]:
    """The events collected, once there are ``count`` of them (or after 10 s)."""
    deadline = time.monotonic() + 10.0
    while len(_events) < int(count) and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(_events)


COMMANDS: dict[str, Callable[..., Any]] = {
    "watch": _watch,
    "events": _events_seen,
    "call": lambda name: asyncrpc.rpc_sync(name, fns.whoami, timeout=30.0),
    "acall": _on_loop,
    "remote": _remote,
    "pass": _pass,
    "fetch": _fetch,
    "drop": _drop,
    "infos": lambda: [info.name for info in asyncrpc.get_worker_infos()],
}


@scenario(
    "dynamic_member",
    option("--auth-key", default=""),
    rpc_timeout=20.0,
    shutdown_timeout=20.0,
)
def dynamic_member(args: argparse.Namespace) -> int:
    """Join a dynamic group (no world size) as ``--name``/``--rank``; then obey stdin."""
    opts = options(args, auth_key=args.auth_key or None)
    init = attempt(lambda: asyncrpc.init_rpc(args.name, rank=args.rank, rpc_backend_options=opts))
    if init["error"] is not None:
        report({"init": init["error"]})
        return 1
    print("JOINED", flush=True)
    for line in sys.stdin:  # bounded by the test, which always ends with "shutdown"
        command, *words = line.split()
        if command in ("shutdown", "leave"):
            if command == "leave":
                _announce_leaving()
            outcome = attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
            # CLOCK_MONOTONIC is one clock for every process of the machine (Linux): the
            # test compares this with its own readings to order events across processes.
            report({"shutdown": outcome, "ended_at": time.monotonic()})
            return 0 if outcome["error"] is None else 3
        outcome = attempt(lambda: COMMANDS[command](*words))  # noqa: B023 (called at once)
        print(f"DONE {command} {json.dumps(outcome, default=repr)}", flush=True)
    return 2  # stdin closed before "shutdown"
