"""What the distributed autograd tests share: counting contexts on every worker, comparing
gradients with a local model's, and running a call on a thread of its own (its own lanes). The
``layers`` fixture, layers made on the workers, is in conftest.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import asyncrpc
from tests.integration import autograd_fns as fns
from tests.integration.conftest import WORLD

WORKERS = [f"w{r}" for r in range(1, WORLD)]


def contexts_everywhere() -> list[int]:
    """Contexts per worker, asked from a thread of its own: calls made inside a context
    would make the workers they reach join it."""
    counts: list[int] = []

    def ask() -> None:
        counts.append(int(asyncrpc.get_debug_info()["num_autograd_contexts"]))
        counts.extend(asyncrpc.rpc_sync(w, fns.num_contexts) for w in WORKERS)

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join(30)
    return counts


def contexts_settle_at(expected: list[int], timeout: float = 10.0) -> list[int]:
    """Contexts per worker once the background releases are done (polled, bounded)."""
    deadline = time.monotonic() + timeout
    counts = contexts_everywhere()
    while counts != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        counts = contexts_everywhere()
    return counts


def assert_grads_match(
    context_id: int, remote: list[tuple[str, asyncrpc.RRef[nn.Module]]], local: list[nn.Module]
) -> None:
    for (worker, rref), module in zip(remote, local, strict=True):
        grads = asyncrpc.rpc_sync(worker, fns.grads_of, args=(context_id, rref))
        for grad, param in zip(grads, module.parameters(), strict=True):
            assert grad is not None
            assert param.grad is not None
            torch.testing.assert_close(grad, param.grad)


def open_lanes(*workers: str) -> None:
    """Open this thread's lane to each of ``workers``: a thread's second call to a worker
    opens one."""
    for _ in range(2):
        for worker in workers:
            asyncrpc.rpc_sync(worker, fns.num_contexts)


def on_a_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (its own lanes, opened by its own calls); its result, or
    its error raised here."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # raised by the test's own thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return out[0]
