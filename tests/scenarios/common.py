"""What every scenario shares (test layer): backend options from the common flags, the
``RESULT {json}`` line a scenario prints, errors described by type, and bounded polls."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import asyncrpc
from tests.ordering import eventually
from tests.scenarios.launch import RESULT_PREFIX, Observations

__all__ = ["RESULT_PREFIX", "Observations", "attempt", "error", "handshake", "options", "poll",
           "poll_value", "report"]  # fmt: skip

T = TypeVar("T")


def options(args: argparse.Namespace, **overrides: Any) -> asyncrpc.RpcBackendOptions:
    """RpcBackendOptions from the common flags, with ``overrides`` set on top."""
    built = asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    for key, value in overrides.items():
        setattr(built, key, value)
    return built


def error(exc: BaseException | None) -> dict[str, Any] | None:
    """Describe ``exc`` by type (the tests assert on types) and by the fields it carries."""
    if exc is None:
        return None
    return {
        "type": type(exc).__name__,
        "mro": [cls.__name__ for cls in type(exc).__mro__],
        "owner": getattr(exc, "owner", None),  # RRef errors name the owner
        "worker": getattr(exc, "worker", None),
        "message": str(exc),
    }


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; return its value or its error, and how long it took."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # the observation is the error itself
        return {"value": None, "error": error(exc), "elapsed": time.monotonic() - start}
    return {"value": value, "error": None, "elapsed": time.monotonic() - start}


def report(observations: Observations) -> None:
    """Print the one ``RESULT {json}`` line that ``ScenarioProcess.result`` reads."""
    print(RESULT_PREFIX + json.dumps(observations, default=repr), flush=True)


def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition()`` came true within ``timeout`` (checked every 20 ms: each check
    may be a call to another worker)."""
    return eventually(condition, timeout, every=0.02)


def poll_value(probe: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    """Call ``probe`` until ``done(value)`` or ``timeout``; return the last value."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.02)
        value = probe()
    return value


def handshake(obs: Observations, ready: str = "READY") -> None:
    """Print ``ready``, wait for the test's line (it kills or stops a worker first) and
    record it under ``stdin``, with the time it came under ``resumed_at``."""
    print(ready, flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    obs["resumed_at"] = time.monotonic()
