"""Driver programs for the stream tests that need a group of their own: rank 0 of
{driver, w1} (test layer).

``python -m tests.integration.stream_scenarios NAME --init-method URL`` joins, runs one
scenario against w1 (started by the test) and prints ``RESULT {json}`` (see
``tests/integration/scenarios.py`` for the test-side half). Scenarios that need w1 killed
print ``STREAMING`` and wait for the test's ``KILLED`` line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import asyncrpc
from tests.integration import stream_fns as sf
from tests.integration.scenarios import Observations, _attempt, _error, _poll, _report


def _join(args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=20.0, shutdown_timeout=10.0
    )
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)


def _wait_killed() -> str:
    print("STREAMING", flush=True)
    return sys.stdin.readline().strip()


def killed_producer(args: argparse.Namespace) -> int:
    """w1 produces an endless stream; the test kills w1 while the driver consumes it."""
    _join(args)
    obs: Observations = {}
    stream = asyncrpc.rpc_stream("w1", sf.tracked, args=("killed",), window=8)
    items = [next(stream) for _ in range(20)]
    obs["stdin"] = _wait_killed()
    error = None
    try:
        items.extend(stream)  # the buffered items, then the loss
    except Exception as exc:  # the observation is the error itself
        error = exc
    obs["error"] = _error(error)
    obs["in_order"] = items == list(range(len(items)))
    obs["count"] = len(items)
    obs["later"] = _attempt(lambda: list(asyncrpc.stream("w1", sf.count, 3)))
    obs["consuming_after"] = asyncrpc.get_metrics()["streams_consuming"]
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(graceful=False))
    _report(obs)
    return 0


def killed_consumer(args: argparse.Namespace) -> int:
    """w1 consumes an endless stream produced here; the test kills w1: the producer stops."""
    _join(args)
    obs: Observations = {}
    consuming = asyncrpc.rpc_async("w1", sf.consume_forever, args=("driver", "victim"))
    obs["producing"] = _poll(lambda: sf.produced("victim") > 10, 10.0)
    obs["stdin"] = _wait_killed()
    obs["consumer_call"] = _attempt(lambda: consuming.wait(10.0))
    # The producer's finally runs here and its entry goes (the consumer's connection died).
    obs["finally_ran"] = _poll(lambda: sf.finally_count("victim") == 1, 10.0)
    obs["producing_after"] = _poll(
        lambda: (
            asyncrpc.get_metrics()["streams_producing"] == 0
            and asyncrpc.get_metrics()["thread_pool_busy"] == 0
        ),
        10.0,
    )
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(graceful=False))
    _report(obs)
    return 0


def shutdown_mid_stream(args: argparse.Namespace) -> int:
    """A graceful shutdown with a stream open: it closes the stream and does not hang."""
    _join(args)
    obs: Observations = {}
    stream = asyncrpc.stream("w1", sf.tracked, "open")
    obs["first"] = [next(stream) for _ in range(5)]
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(graceful=True, timeout=10.0))
    # Items already fetched may still come out of the stream; then it says it was closed.
    obs["rest"] = _attempt(lambda: sum(1 for _ in stream))
    _report(obs)
    return 0


SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {
    "killed_producer": killed_producer,
    "killed_consumer": killed_consumer,
    "shutdown_mid_stream": shutdown_mid_stream,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--init-method", required=True)
    args = parser.parse_args(argv)
    return SCENARIOS[args.scenario](args)


if __name__ == "__main__":
    sys.exit(main())
