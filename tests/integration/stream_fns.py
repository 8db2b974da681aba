"""Generators and helpers the stream tests run on workers (importable by every process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import inline

# What ran on this worker, by the tag each test picks: how many items each tracked
# generator produced (advanced to), and how many times its finally block ran.
PRODUCED: dict[str, int] = {}
FINALLY: dict[str, int] = {}


class ProducerError(Exception):
    """Raised by a producer mid-stream; the consumer must get this very type."""

    def __init__(self, message: str, after: int) -> None:
        super().__init__(message, after)
        self.after = after


def count(n: int) -> Iterator[int]:
    yield from range(n)


async def acount(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i
        if i % 1000 == 0:
            await asyncio.sleep(0)


def tracked(tag: str, n: int | None = None, delay: float = 0.0) -> Iterator[int]:
    """Counts up (forever with ``n=None``), noting progress and its finally block."""
    i = 0
    try:
        while n is None or i < n:
            PRODUCED[tag] = i + 1
            yield i
            i += 1
            if delay:
                time.sleep(delay)
    finally:
        FINALLY[tag] = FINALLY.get(tag, 0) + 1


async def atracked(tag: str, n: int | None = None, delay: float = 0.0) -> AsyncIterator[int]:
    i = 0
    try:
        while n is None or i < n:
            PRODUCED[tag] = i + 1
            yield i
            i += 1
            await asyncio.sleep(delay)
    finally:
        FINALLY[tag] = FINALLY.get(tag, 0) + 1


def failing(n: int) -> Iterator[int]:
    yield from range(n)
    raise ProducerError("the producer broke", n)


async def afailing(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i
    raise ProducerError("the async producer broke", n)


def not_a_generator() -> int:
    return 5


def returns_iterator(n: int) -> list[str]:
    """A plain function returning an iterable: it runs on the pool, then is iterated."""
    return [str(i) for i in range(n)]


def tensors(n: int, floats: int) -> Iterator[torch.Tensor]:
    for i in range(n):
        yield torch.full((floats,), float(i))


def blobs(tag: str, n: int, nbytes: int) -> Iterator[torch.Tensor]:
    """``n`` tensors of ``nbytes`` each (item i filled with i), noting progress as
    ``tracked`` does: the producer's own count of the items it made."""
    for i in range(n):
        PRODUCED[tag] = i + 1
        yield torch.full((nbytes,), i % 128, dtype=torch.uint8)


async def ablobs(tag: str, n: int, nbytes: int) -> AsyncIterator[torch.Tensor]:
    for i in range(n):
        PRODUCED[tag] = i + 1
        yield torch.full((nbytes,), i % 128, dtype=torch.uint8)


def produced(tag: str) -> int:
    return PRODUCED.get(tag, 0)


def finally_count(tag: str) -> int:
    return FINALLY.get(tag, 0)


@inline
def leaving() -> bool:
    """Whether this worker's shutdown has begun (on the loop, as a peer sees it)."""
    return bool(asyncrpc.get_debug_info()["leaving"])


@inline
def stream_metrics() -> dict[str, Any]:
    """On the loop: a pool thread serving it would count as busy."""
    return asyncrpc.get_metrics()


def consume(to: str, n: int) -> list[int]:
    """A synchronous consumer on a pool thread of this worker."""
    return list(asyncrpc.stream(to, count, n))


def consume_tracked(to: str, tag: str, n: int, delay: float) -> list[int]:
    """A synchronous consumer of ``to``'s ``tracked`` stream (n items, ``delay`` apart)."""
    return list(asyncrpc.stream(to, tracked, tag, n, delay))


async def aconsume(to: str, n: int) -> list[int]:
    """An asyncio consumer on this worker's loop (the agent's own loop on an async worker)."""
    return [x async for x in asyncrpc.stream(to, acount, n)]


@inline
def iterate_on_loop(to: str) -> str:
    """``for`` over a stream on the agent's loop thread: refused, never a deadlock."""
    try:
        for _ in asyncrpc.stream(to, count, 3):
            pass
    except asyncrpc.BlockingCallError as exc:
        return type(exc).__name__
    return "iterated"


class Counter:
    """An actor with generator methods, for ``rref.stream().method(...)``."""

    def __init__(self, start: int) -> None:
        self.start = start

    def up(self, n: int) -> Iterator[int]:
        yield from range(self.start, self.start + n)

    async def aup(self, n: int) -> AsyncIterator[int]:
        for i in range(self.start, self.start + n):
            yield i


def consume_forever(to: str, tag: str) -> int:
    """A slow synchronous consumer of an endless stream (until its worker dies)."""
    taken = 0
    for _ in asyncrpc.stream(to, tracked, tag):
        taken += 1
        time.sleep(0.01)
    return taken


def grad_items(n: int) -> Iterator[torch.Tensor]:
    """Items that require grad (refused inside a distributed autograd context)."""
    for i in range(n):
        yield torch.full((2,), float(i), requires_grad=True)


def remaining_items(n: int) -> Iterator[float | None]:
    """Yields what ``time_remaining()`` says inside the producer, ``n`` times."""
    for _ in range(n):
        yield asyncrpc.time_remaining()


async def aremaining_items(n: int) -> AsyncIterator[float | None]:
    for _ in range(n):
        yield asyncrpc.time_remaining()
