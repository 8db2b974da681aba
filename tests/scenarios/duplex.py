"""Scenarios of client and bidirectional streams that need a group of their own (test
layer): rank 0 of {driver, w1}, where w1 is started by the test. Scenarios that need w1
killed print ``STREAMING`` and wait for the test's ``KILLED`` line."""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from typing import Any

import asyncrpc
from tests.integration import duplex_fns as df
from tests.integration import stream_fns as sf
from tests.scenarios.common import Observations, attempt, error, poll, report
from tests.scenarios.registry import scenario


def _join(args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=20.0, shutdown_timeout=10.0
    )
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)
    # w1 calls shutdown() right after joining (torch's passive workers' way): wait until
    # it has begun, so that what follows runs in a worker serving through its shutdown.
    poll(lambda: asyncrpc.rpc_sync("w1", sf.leaving), 30.0)


def _wait_killed() -> str:
    print("STREAMING", flush=True)
    return sys.stdin.readline().strip()


def _clean_here() -> bool:
    def clean() -> bool:
        m = asyncrpc.get_metrics()
        keys = ("streams_producing", "streams_consuming", "stream_args_held", "thread_pool_busy")
        return all(m[key] == 0 for key in keys)

    return poll(clean, 10.0)


@scenario("bidi_killed_callee")
def bidi_killed_callee(args: argparse.Namespace) -> int:
    """The driver has a bidirectional stream open with w1; the test kills w1."""
    _join(args)
    obs: Observations = {}
    b = asyncrpc.bidi("w1", df.doubler_sync)
    replies = []
    for i in range(10):
        b.send(i).wait(10)
        replies.append(next(b))
    obs["replies"] = replies
    obs["stdin"] = _wait_killed()
    failure = None
    try:
        for _ in range(1000):  # bounded: the loss ends it long before
            b.send(0).wait(10)
            next(b)
    except Exception as exc:  # the observation is the error itself
        failure = exc
    obs["error"] = error(failure)
    obs["send_after"] = attempt(lambda: b.send(1).wait(10))
    obs["clean"] = _clean_here()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("stream_arg_killed_callee")
def stream_arg_killed_callee(args: argparse.Namespace) -> int:
    """The driver streams an endless argument to w1; the test kills w1: the call fails
    with the loss and the driver's source is closed (its finally runs here)."""
    _join(args)
    obs: Observations = {}
    source = df.slow_source("victim", 10**9, 0.001)
    call = asyncrpc.rpc_async("w1", df.read_noted, args=(asyncrpc.stream_arg(source), "victim"))
    obs["streaming"] = poll(lambda: len(df.SEEN.get("victim", ())) > 20, 10.0)
    obs["stdin"] = _wait_killed()
    obs["call"] = attempt(lambda: call.wait(10.0))
    obs["finally_ran"] = poll(lambda: df.ENDED.get("victim") == "finally", 10.0)
    obs["clean"] = _clean_here()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("bidi_killed_caller")
def bidi_killed_caller(args: argparse.Namespace) -> int:
    """w1 has a bidirectional stream open with the driver (the callee); the test kills w1:
    the driver's function reading the requests gets the loss."""
    _join(args)
    obs: Observations = {}
    asyncrpc.rpc_async("w1", df.bidi_forever, args=("driver", "served"))
    obs["streaming"] = poll(lambda: len(df.SEEN.get("served", ())) > 10, 10.0)
    obs["stdin"] = _wait_killed()
    obs["ended"] = poll(lambda: df.ENDED.get("served") is not None, 10.0) and df.ENDED["served"]
    obs["clean"] = _clean_here()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("bidi_shutdown")
def bidi_shutdown(args: argparse.Namespace) -> int:
    """A graceful shutdown with a bidirectional stream open: it closes the stream (replies
    end with ClosedError, sending fails) and does not hang."""
    _join(args)
    obs: Observations = {}
    b = asyncrpc.bidi("w1", df.noted_doubler, "open")
    first: list[Any] = []
    for i in range(5):
        b.send(i).wait(10)
        first.append(next(b))
    obs["first"] = first
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=10.0))
    obs["rest"] = attempt(lambda: sum(1 for _ in b))
    obs["send_after"] = attempt(lambda: b.send(1).wait(10))
    report(obs)
    return 0


@scenario("callee_shutdown_reads_on")
def callee_shutdown_reads_on(args: argparse.Namespace) -> int:
    """w1 sends the driver a stream argument, slowly; the driver, reading it for w1's call,
    begins a graceful shutdown meanwhile: it reads the stream to its end (serving a
    request), and the shutdown completes after."""
    _join(args)
    obs: Observations = {}
    call = asyncrpc.rpc_async("w1", df.send_slowly_to, args=("driver", "served", 100))
    obs["reading"] = poll(lambda: len(df.SEEN.get("served", ())) >= 5, 20.0)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=30.0))
    obs["seen"] = df.SEEN.get("served")
    obs["ended"] = df.ENDED.get("served")
    obs["call"] = attempt(lambda: call.wait(1.0))
    report(obs)
    return 0


@scenario("late_reader")
def late_reader(args: argparse.Namespace) -> int:
    """The driver's default rpc_timeout is 1 s; w1's function holds its stream argument 3 s
    before reading it (the call itself has 20 s): the argument, claimed on arrival, waits
    for it. One whose request never arrived would have been closed after 1 s."""
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=1.0, shutdown_timeout=10.0
    )
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)
    obs: Observations = {}
    arg = asyncrpc.stream_arg(range(100))
    obs["late"] = attempt(
        lambda: asyncrpc.rpc_sync("w1", df.reads_late, args=(arg, 3.0), timeout=20.0)
    )
    obs["held"] = asyncrpc.get_metrics()["stream_args_held"]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=10.0))
    report(obs)
    return 0


@scenario("stream_arg_killed_before_reading")
def stream_arg_killed_before_reading(args: argparse.Namespace) -> int:
    """w1 received a stream argument (claimed it) and holds it unread; the test kills w1:
    once w1 is declared lost (for good, not on the connection's loss: a connection may
    heal, and its callee read on), the driver closes the iterable it held for w1."""
    _join(args)
    obs: Observations = {}
    source = df.slow_source("unread", 10, 0.0)
    call = asyncrpc.rpc_async(
        "w1", df.reads_late, args=(asyncrpc.stream_arg(source), 60.0), timeout=0
    )
    obs["claimed"] = poll(
        lambda: (
            asyncrpc.get_metrics()["stream_args_held"] == 1
            and asyncrpc.get_metrics()["stream_args_unclaimed"] == 0
        ),
        10.0,
    )
    obs["stdin"] = _wait_killed()
    start = time.monotonic()
    obs["call"] = attempt(lambda: call.wait(10.0))
    # Its expiry (the default rpc_timeout, 20 s) would release it too: well before that.
    obs["released"] = poll(lambda: asyncrpc.get_metrics()["stream_args_held"] == 0, 15.0)
    obs["lost_after"] = time.monotonic() - start
    obs["source_closed"] = poll(
        lambda: inspect.getgeneratorstate(source) == inspect.GEN_CLOSED, 5.0
    )
    obs["elapsed"] = time.monotonic() - start
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0
