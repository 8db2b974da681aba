"""What the tracing test's workers run: the functions a traced chain calls (imported by
reference on every worker). Their spans are kept by the test kit's ``record_spans``."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import asyncrpc


def leaf(x: int) -> int:
    return x + 1


def hop(peer: str, x: int) -> int:
    """Calls ``peer`` from inside a served call: its span is this call's child."""
    return asyncrpc.rpc_sync(peer, leaf, args=(x,)) * 10


async def async_hop(peer: str, x: int) -> int:
    return (await asyncrpc.rpc_async(peer, leaf, args=(x,))) * 10


def fail() -> None:
    raise KeyError("traced")


def count(n: int) -> Iterator[int]:
    yield from range(n)


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def size_of(x: torch.Tensor) -> int:
    """A small reply to a large request: the message sizes differ by far."""
    return x.numel() * x.element_size()


async def async_size_of(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()
