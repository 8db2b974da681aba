"""Functions the client-stream and bidirectional-stream tests run on workers (importable
by every process). What a callee saw is kept here, by the tag each test picks, and asked
of the callee itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import inline

# What each tagged callee function saw: the items it read, and how it ended.
SEEN: dict[str, list[Any]] = {}
ENDED: dict[str, str] = {}


class ReaderError(Exception):
    """Raised by a callee reading a stream argument; the caller must get this type."""


def total(xs: Iterable[int]) -> int:
    """A synchronous callee (on the pool): reads the whole stream with ``for``."""
    return sum(xs)


async def atotal(xs: AsyncIterator[int]) -> int:
    """An asyncio callee (on the loop): reads it with ``async for``."""
    return sum([x async for x in xs])


def tensor_sum(xs: Iterable[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(4)
    for x in xs:
        out += x
    return out


async def read_some(xs: AsyncIterator[int], n: int) -> list[int]:
    """Reads ``n`` items and returns: the rest of the stream is never read."""
    got = []
    async for x in xs:
        got.append(x)
        if len(got) == n:
            break
    return got


def read_some_sync(xs: Iterable[int], n: int) -> list[int]:
    got = []
    for x in xs:
        got.append(x)
        if len(got) == n:
            break
    return got


async def read_then_fail(xs: AsyncIterator[int], n: int) -> None:
    async for x in xs:
        if x == n:
            raise ReaderError(f"the reader broke at {n}")


async def read_noted(xs: AsyncIterator[Any], tag: str) -> int:
    """Reads until the stream ends, noting each item and how the reading ended."""
    SEEN[tag] = []
    try:
        async for x in xs:
            SEEN[tag].append(x)
    except BaseException as exc:
        ENDED[tag] = type(exc).__name__
        raise
    ENDED[tag] = "end"
    return len(SEEN[tag])


def read_noted_sync(xs: Iterable[Any], tag: str) -> int:
    SEEN[tag] = []
    try:
        for x in xs:
            SEEN[tag].append(x)
    except BaseException as exc:
        ENDED[tag] = type(exc).__name__
        raise
    ENDED[tag] = "end"
    return len(SEEN[tag])


async def read_slowly(xs: AsyncIterator[Any], tag: str) -> int:
    """Reads one item a second, noting how it ended (a cancellation, say)."""
    SEEN[tag] = []
    try:
        async for x in xs:
            SEEN[tag].append(x)
            await asyncio.sleep(1.0)
    except BaseException as exc:
        ENDED[tag] = type(exc).__name__
        raise
    ENDED[tag] = "end"
    return len(SEEN[tag])


def error_type_of_reading(xs: Iterable[Any]) -> str:
    """Reads ``xs`` on the pool, returning the type of what stopped it (or 'end')."""
    try:
        for _ in xs:
            pass
    except Exception as exc:
        return type(exc).__name__
    return "end"


@inline
def seen(tag: str) -> list[Any] | None:
    return SEEN.get(tag)


@inline
def ended(tag: str) -> str | None:
    return ENDED.get(tag)


# -- bidirectional ---------------------------------------------------------------------------


async def doubler(requests: AsyncIterator[int]) -> AsyncIterator[int]:
    async for r in requests:
        yield 2 * r


def doubler_sync(requests: Iterable[int]) -> Iterator[int]:
    for r in requests:
        yield 2 * r


async def adder(requests: AsyncIterator[torch.Tensor], bias: float) -> AsyncIterator[Any]:
    """Replies to each tensor with it plus ``bias``; after the requests, their count."""
    n = 0
    async for r in requests:
        n += 1
        yield r + bias
    yield n


async def noted_doubler(requests: AsyncIterator[int], tag: str) -> AsyncIterator[int]:
    SEEN[tag] = []
    try:
        async for r in requests:
            SEEN[tag].append(r)
            yield 2 * r
    except BaseException as exc:
        ENDED[tag] = type(exc).__name__
        raise
    finally:
        ENDED.setdefault(tag, "end")


async def fail_after(requests: AsyncIterator[int], n: int) -> AsyncIterator[int]:
    async for r in requests:
        if r == n:
            raise ReaderError(f"the replier broke at {n}")
        yield r


async def waits_for_requests(requests: AsyncIterator[int], tag: str) -> AsyncIterator[int]:
    """Never replies; notes how it ended (the stream's deadline closes it)."""
    try:
        async for r in requests:
            SEEN.setdefault(tag, []).append(r)
        yield -1
    finally:
        ENDED[tag] = "closed"


class Learner:
    """An actor for ``rref.bidi().method(...)`` and stream arguments through proxies."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.total = 0

    async def train(self, requests: AsyncIterator[int]) -> AsyncIterator[int]:
        async for r in requests:
            self.total += r
            yield self.scale * self.total

    def add_all(self, xs: Iterable[int]) -> int:
        for x in xs:
            self.total += x
        return self.total


def slow_source(tag: str, n: int, delay: float) -> Iterator[int]:
    """A caller-side source noting its progress and whether its finally ran."""
    try:
        for i in range(n):
            SEEN.setdefault(tag, []).append(i)
            yield i
            time.sleep(delay)
    finally:
        ENDED[tag] = "finally"


async def aslow_source(tag: str, n: int, delay: float) -> AsyncIterator[int]:
    try:
        for i in range(n):
            SEEN.setdefault(tag, []).append(i)
            yield i
            await asyncio.sleep(delay)
    finally:
        ENDED[tag] = "finally"


class SourceError(Exception):
    """Raised by a caller's source mid-stream; the callee's reading must get this type."""


def failing_source(n: int) -> Iterator[int]:
    yield from range(n)
    raise SourceError(f"the source broke after {n}")


def relay(to: str, n: int) -> int:
    """On a worker: streams ``range(n)`` to ``to``'s ``total``, from a pool thread."""
    return int(asyncrpc.rpc_sync(to, total, args=(asyncrpc.stream_arg(range(n)),)))


async def arelay_bidi(to: str, n: int) -> list[int]:
    """On a worker's loop: a bidirectional stream to ``to``, sending and reading at once."""
    b = asyncrpc.bidi(to, doubler)
    got: list[int] = []

    async def send() -> None:
        for i in range(n):
            await b.send(i)
        b.done_sending()

    sender = asyncio.ensure_future(send())
    async for r in b:
        got.append(r)
    await sender
    return got


def bidi_forever(to: str, tag: str) -> int:
    """On a worker's pool: sends to ``to``'s ``noted_doubler`` until it fails; replies read
    on the side. Runs until this worker dies (the test kills it)."""
    b = asyncrpc.bidi(to, noted_doubler, tag)
    i = 0
    while True:
        b.send(i).wait(30)
        next(b)
        i += 1
        time.sleep(0.01)


def ignores(xs: Any) -> str:
    """Never reads its stream argument."""
    return type(xs).__name__


def forwards(xs: Any, to: str) -> int:
    """Passes its stream argument on, unread, to ``to``'s ``total``."""
    return int(asyncrpc.rpc_sync(to, total, args=(xs,)))


# -- gradients through streams ---------------------------------------------------------------


def scaled(x: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
    """Yields ``x * k`` for k = 1..n: each item's gradient reaches ``x`` on the caller."""
    for k in range(1, n + 1):
        yield x * k


async def ascaled(x: torch.Tensor, n: int) -> AsyncIterator[torch.Tensor]:
    for k in range(1, n + 1):
        yield x * k


def summed(xs: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sums a stream argument of tensors requiring grad (on the pool)."""
    out: torch.Tensor | None = None
    for x in xs:
        out = x if out is None else out + x
    assert out is not None
    return out


async def tripled(requests: AsyncIterator[torch.Tensor]) -> AsyncIterator[torch.Tensor]:
    async for r in requests:
        yield r * 3


def send_slowly_to(to: str, tag: str, n: int) -> int:
    """On a worker: streams ``n`` items, 20 ms apart, to ``to``'s ``read_noted``."""
    arg = asyncrpc.stream_arg(slow_source(tag, n, 0.02))
    return int(asyncrpc.rpc_sync(to, read_noted, args=(arg, tag)))


async def never_reads(requests: AsyncIterator[int], tag: str) -> AsyncIterator[int]:
    """A bidirectional function that reads no request until told (``release``)."""
    GATES[tag] = asyncio.Event()
    await GATES[tag].wait()
    async for r in requests:
        yield r


GATES: dict[str, asyncio.Event] = {}


@inline
def release(tag: str) -> bool:
    gate = GATES.get(tag)
    if gate is None:
        return False
    gate.set()
    return True


async def reads_late(xs: AsyncIterator[int], delay: float) -> int:
    """Holds its stream argument ``delay`` seconds before reading it."""
    await asyncio.sleep(delay)
    return sum([x async for x in xs])


def blobs(tag: str, n: int, nbytes: int) -> Iterator[torch.Tensor]:
    """A caller-side source of ``n`` tensors of ``nbytes``, noting how many it made."""
    for i in range(n):
        SEEN.setdefault(tag, []).append(i)
        yield torch.full((nbytes,), i % 128, dtype=torch.uint8)


async def held_then_read(xs: AsyncIterator[torch.Tensor], tag: str) -> int:
    """Opens its stream argument, takes nothing until ``release(tag)``, then reads it all."""
    GATES[tag] = asyncio.Event()
    await xs.__anext__()
    await GATES[tag].wait()
    return 1 + sum([1 async for _ in xs])
