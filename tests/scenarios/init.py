"""Scenarios about starting a group (test layer): one member per process (rendezvous
variants, duplicates, torch's options, faults injected around the rendezvous), calls sent
while the first connection is made, the asyncio style, and the API outside a group."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import threading
import time
from typing import Any

import asyncrpc
from asyncrpc.errors import NotInitializedError
from asyncrpc.runtime.current import current_agent
from asyncrpc.runtime.group import rendezvous
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, error, options, report
from tests.scenarios.registry import option, scenario


def _claim_size_last() -> None:
    """Fault injection: this member compares world sizes only once another member has
    recorded its own (waits for that key, bounded), so it is the one to see a difference."""
    original = rendezvous.StoreGroup.claim_kind

    def late(group: rendezvous.StoreGroup) -> None:
        deadline = time.monotonic() + 20.0
        while not group.store.check(["asyncrpc/kind"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        original(group)

    rendezvous.StoreGroup.claim_kind = late  # type: ignore[method-assign]


@scenario(
    "startup",
    option("--call", action="append", default=[]),
    option("--claim-last", action="store_true"),
    option("--exit-at-once", action="store_true"),
    option("--exit-after-init", action="store_true"),
)
def startup(args: argparse.Namespace) -> int:
    """Join as ``--name``/``--rank``; then call each ``--call`` peer and shut down.

    ``--exit-at-once``: a failed init ends the process at once (``os._exit``, no teardown);
    ``--exit-after-init``: a successful one too (the store host leaving right after start).
    Exits 1 when init_rpc fails, 0 otherwise.
    """
    if args.claim_last:
        _claim_size_last()
    opts = options(args, shutdown_timeout=args.rpc_timeout)
    rank = -1 if args.rank is None else args.rank
    init = attempt(lambda: asyncrpc.init_rpc(args.name, None, rank, args.world_size, opts))
    obs: Observations = {"init": init}
    if init["error"] is not None or args.exit_after_init:
        report(obs)
        code = 1 if init["error"] is not None else 0
        if args.exit_at_once or args.exit_after_init:
            sys.stdout.flush()
            os._exit(code)  # no teardown: the store (rank 0's) goes at once
        return code
    obs["calls"] = {
        peer: attempt(functools.partial(asyncrpc.rpc_sync, peer, fns.pid)) for peer in args.call
    }
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=args.rpc_timeout))
    report(obs)
    return 0


# -- scenario: one member of a group (rendezvous variants, duplicates) ---------------------


def _member_options(args: argparse.Namespace) -> object:
    if not args.torch_options:
        return options(args)
    return _rpc_names(args).TensorPipeRpcBackendOptions(
        init_method=args.init_method, rpc_timeout=args.rpc_timeout, num_worker_threads=8
    )


def _rpc_names(args: argparse.Namespace) -> Any:
    if args.names_from == "asyncrpc":
        return asyncrpc
    import torch.distributed.rpc as torch_rpc

    return torch_rpc


def _delay_registration(seconds: float) -> None:
    """Fault injection: the thread that called init_rpc registers the new agent late.

    Models that thread being descheduled between the agent's start (on its loop thread)
    and ``set_agent``; nothing in the library is changed.
    """
    import asyncrpc.api
    from asyncrpc.runtime.current import set_agent

    def late(agent: Any) -> None:
        time.sleep(seconds)
        set_agent(agent)

    vars(asyncrpc.api)["set_agent"] = late


@scenario(
    "member",
    option("--torch-options", action="store_true"),
    # Where --torch-options takes TensorPipeRpcBackendOptions and BackendType from: torch,
    # or asyncrpc's own names of them (a program whose only change is the import).
    option("--names-from", choices=["torch", "asyncrpc"], default="torch"),
    option("--call", action="append", default=[]),
    option("--call-fn", choices=("pid", "whoami"), default="pid"),
    option("--slow-register", type=float, default=0.0),
)
def member(args: argparse.Namespace) -> int:
    """Join as ``--name``/``--rank``, call each ``--call`` peer, then shut down.

    The call is ``--call-fn`` (``pid``, or ``whoami`` which needs the callee's agent
    registered); each outcome is recorded, never raised.

    Exits 1 when init_rpc fails (the error is in the JSON), 0 otherwise.
    """
    backend = None
    if args.torch_options:
        backend = _rpc_names(args).BackendType.TENSORPIPE
    if args.slow_register > 0:
        _delay_registration(args.slow_register)
    rank = -1 if args.rank is None else args.rank
    init = attempt(
        lambda: asyncrpc.init_rpc(
            args.name, backend, rank, args.world_size, rpc_backend_options=_member_options(args)
        )
    )
    obs: Observations = {"init": init}
    if init["error"] is not None:
        report(obs)
        return 1
    obs["rank"] = asyncrpc.get_worker_info().id
    obs["world"] = [info.name for info in asyncrpc.get_worker_infos()]
    obs["rpc_timeout"] = asyncrpc.get_rpc_timeout()
    obs["thread_pool_size"] = asyncrpc.get_metrics()["thread_pool_size"]
    fn = fns.whoami if args.call_fn == "whoami" else fns.pid
    obs["pid"] = os.getpid()
    obs["calls"] = {
        peer: attempt(functools.partial(asyncrpc.rpc_sync, peer, fn)) for peer in args.call
    }
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
    report(obs)
    return 0 if obs["shutdown"]["error"] is None else 3


# -- scenario: calls sent while the first connection is being made ------------------------


@scenario("first_calls_in_order")
def first_calls_in_order(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}: fire many calls to w1 before any connection to it exists.

    The first ones wait for the connection; the later ones find it made. Observes the order
    in which w1's loop ran them (an ``@inline`` function records each as it is read).
    """
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options(args))
    futures = []
    for i in range(400):  # paced: the calls straddle the moment the connection is made
        futures.append(asyncrpc.rpc_async("w1", fns.inline_record, args=(i,)))
        time.sleep(0.0001)
    obs: Observations = {"calls": attempt(lambda: asyncrpc.wait_all(futures) and None)}
    obs["arrivals"] = asyncrpc.rpc_sync("w1", fns.arrivals)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
    report(obs)
    return 0


# -- scenario: the asyncio style (the agent on the program's own loop) ---------------------


async def _cancelled_remotely(tag: str) -> bool:
    for _ in range(100):
        if await asyncrpc.call("w1", fns.was_cancelled, tag):
            return True
        await asyncio.sleep(0.02)
    return False


async def _asyncio_checks(obs: Observations) -> None:
    agent = current_agent()
    obs["agent_on_running_loop"] = agent.loop.aio is asyncio.get_running_loop()
    obs["agent_on_this_thread"] = agent.loop.thread_id == threading.get_ident()
    obs["loop_threads"] = [t.name for t in threading.enumerate() if t.name == "asyncrpc-driver"]
    obs["call"] = await asyncrpc.call("w1", fns.add, 20, 22)
    try:
        async with asyncio.timeout(0.3):
            obs["finished"] = await asyncrpc.call(
                "w1", fns.async_sleep_noting_cancel, 20.0, "asyncio-style"
            )
        obs["timeout_error"] = None
    except TimeoutError as exc:
        obs["timeout_error"] = error(exc)
    obs["remote_cancelled"] = await _cancelled_remotely("asyncio-style")
    obs["blocking_on_loop"] = attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 1)))
    obs["from_thread"] = await asyncio.to_thread(asyncrpc.rpc_sync, "w1", fns.add, (2, 3))
    obs["call_after_thread"] = await asyncrpc.call("w1", fns.async_add, 1, 2)


async def _asyncio_style(args: argparse.Namespace) -> Observations:
    obs: Observations = {"threads_before": threading.active_count()}
    async with asyncrpc.worker(
        "driver", rank=0, world_size=2, rpc_backend_options=options(args)
    ) as info:
        obs["info"] = [info.name, info.id]
        obs["threads_inside"] = threading.active_count()
        await _asyncio_checks(obs)
    obs["shut_down"] = attempt(asyncrpc.get_worker_info)["error"]
    return obs


@scenario("asyncio_style")
def asyncio_style(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1} under ``async with asyncrpc.worker(...)`` on asyncio.run."""
    report(asyncio.run(_asyncio_style(args)))
    return 0


# -- scenario: the API before init_rpc and after shutdown ----------------------------------


@scenario("not_initialized")
def not_initialized(args: argparse.Namespace) -> int:
    """rpc_sync before init_rpc, a group of one, then rpc_sync after its shutdown."""
    obs: Observations = {
        "before": attempt(lambda: asyncrpc.rpc_sync("solo", fns.add, args=(1, 2)))["error"]
    }
    asyncrpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options(args))
    obs["during"] = asyncrpc.rpc_sync("solo", fns.add, args=(1, 2))
    asyncrpc.shutdown()
    obs["after"] = attempt(lambda: asyncrpc.rpc_sync("solo", fns.add, args=(1, 2)))["error"]
    obs["is_runtime_error"] = isinstance(NotInitializedError(), RuntimeError)
    report(obs)
    return 0
