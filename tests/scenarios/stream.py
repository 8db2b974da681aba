"""Scenarios of streams that need a group of their own (test layer): rank 0 of
{driver, w1}, where w1 is started by the test. Scenarios that need w1 killed print
``STREAMING`` and wait for the test's ``KILLED`` line."""

from __future__ import annotations

import argparse
import sys

import asyncrpc
from tests.integration import stream_fns as sf
from tests.scenarios.common import Observations, attempt, error, poll, report
from tests.scenarios.registry import scenario


def _join(args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=20.0, shutdown_timeout=10.0
    )
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)


def _w1_in_shutdown() -> bool:
    """Wait until w1, which calls shutdown() right after joining (torch's passive
    workers' way), has begun it: a shutdown ends the streams its worker consumes, so a
    stream w1 consumes must start after that, or a late shutdown on a loaded machine ends
    it mid-read (seen in CI as a ClosedError instead of the loss)."""
    return poll(lambda: asyncrpc.rpc_sync("w1", sf.leaving), 30.0)


def _wait_killed() -> str:
    print("STREAMING", flush=True)
    return sys.stdin.readline().strip()


@scenario("killed_producer")
def killed_producer(args: argparse.Namespace) -> int:
    """w1 produces an endless stream; the test kills w1 while the driver consumes it."""
    _join(args)
    obs: Observations = {}
    stream = asyncrpc.rpc_stream("w1", sf.tracked, args=("killed",), window=8)
    items = [next(stream) for _ in range(20)]
    obs["stdin"] = _wait_killed()
    failure = None
    try:
        items.extend(stream)  # the buffered items, then the loss
    except Exception as exc:  # the observation is the error itself
        failure = exc
    obs["error"] = error(failure)
    obs["in_order"] = items == list(range(len(items)))
    obs["count"] = len(items)
    obs["later"] = attempt(lambda: list(asyncrpc.stream("w1", sf.count, 3)))
    obs["consuming_after"] = asyncrpc.get_metrics()["streams_consuming"]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("killed_consumer")
def killed_consumer(args: argparse.Namespace) -> int:
    """w1 consumes an endless stream produced here; the test kills w1: the producer stops."""
    _join(args)
    obs: Observations = {"w1_in_shutdown": _w1_in_shutdown()}
    consuming = asyncrpc.rpc_async("w1", sf.consume_forever, args=("driver", "victim"))
    obs["producing"] = poll(lambda: sf.produced("victim") > 10, 10.0)
    obs["stdin"] = _wait_killed()
    obs["consumer_call"] = attempt(lambda: consuming.wait(10.0))
    # The producer's finally runs here and its entry goes (the consumer's connection died).
    obs["finally_ran"] = poll(lambda: sf.finally_count("victim") == 1, 10.0)
    obs["producing_after"] = poll(
        lambda: (
            asyncrpc.get_metrics()["streams_producing"] == 0
            and asyncrpc.get_metrics()["thread_pool_busy"] == 0
        ),
        10.0,
    )
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=False))
    report(obs)
    return 0


@scenario("producer_shutdown")
def producer_shutdown(args: argparse.Namespace) -> int:
    """This worker produces a stream w1 consumes and calls shutdown meanwhile (as torch's
    passive workers do right after joining): the stream goes on to its end."""
    _join(args)
    obs: Observations = {"w1_in_shutdown": _w1_in_shutdown()}
    consuming = asyncrpc.rpc_async("w1", sf.consume_tracked, args=("driver", "served", 40, 0.01))
    obs["started"] = poll(lambda: sf.produced("served") >= 5, 10.0)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=20.0))
    obs["consumed"] = attempt(lambda: consuming.wait(1.0))
    obs["produced"] = sf.produced("served")
    report(obs)
    return 0


@scenario("shutdown_mid_stream")
def shutdown_mid_stream(args: argparse.Namespace) -> int:
    """A graceful shutdown with a stream open: it closes the stream and does not hang."""
    _join(args)
    obs: Observations = {}
    stream = asyncrpc.stream("w1", sf.tracked, "open")
    obs["first"] = [next(stream) for _ in range(5)]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=10.0))
    # Items already fetched may still come out of the stream; then it says it was closed.
    obs["rest"] = attempt(lambda: sum(1 for _ in stream))
    report(obs)
    return 0
