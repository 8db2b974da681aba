"""The functions the benchmark calls remotely, and the parameter server's state.

Part of ``asyncrpc.bench``. Both RPC systems pickle these by reference, so the server
processes import this module; nothing here depends on which RPC system runs it, except the
parameter-RRef makers of dist-autograd, one per system (each builds its own RRef type).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from asyncrpc import RRef
from asyncrpc.bench.config import AUTOGRAD_BATCH, AUTOGRAD_FEATURES, PS_SHAPES
from asyncrpc.functions import inline

__all__ = [
    "AUTOGRAD_LR",
    "PS_LR",
    "async_noop",
    "autograd_batch",
    "bidi_echo",
    "echo",
    "fake_grads",
    "forward",
    "make_layer",
    "noop",
    "parameter_rrefs",
    "ps_pull",
    "ps_push",
    "stream_count",
    "stream_fresh_tensors",
    "stream_items",
    "stream_progress",
    "stream_tensors",
    "torch_async_noop",
    "torch_parameter_rrefs",
    "value",
]

F = TypeVar("F", bound=Callable[..., Any])


def _identity(fn: F) -> F:
    return fn


try:  # torch builds without distributed support still run the other systems
    from torch.distributed.rpc.functions import async_execution as _torch_async_execution
except ImportError:  # pragma: no cover - depends on the torch build
    _torch_async_execution = _identity


def noop() -> None:
    """A synchronous no-op (runs on the callee's thread pool)."""


@inline
def inline_noop() -> None:
    """A synchronous no-op marked ``@inline`` (runs on asyncrpc's event loop)."""


async def async_noop() -> None:
    """An ``async def`` no-op (runs on asyncrpc's event loop)."""


@_torch_async_execution  # type: ignore[untyped-decorator]
def torch_async_noop() -> torch.futures.Future[None]:
    """torch's nearest thing to an ``async def`` no-op: an ``@async_execution`` function
    whose future is already complete (torch cannot run coroutines)."""
    fut: torch.futures.Future[None] = torch.futures.Future()
    fut.set_result(None)
    return fut


def value() -> int:
    """A small value for ``remote()`` + ``to_here()``."""
    return 42


def echo(tensor: torch.Tensor) -> torch.Tensor:
    """Send the received tensor back unchanged."""
    return tensor


# -- parameter server ----------------------------------------------------------------------

PS_LR = 1e-3

_ps_lock = threading.Lock()
_ps_params: list[torch.Tensor] = []
_ps_version = 0


def _params() -> list[torch.Tensor]:
    # Created on first use, under the lock, so concurrent trainers see one model.
    if not _ps_params:
        _ps_params.extend(torch.randn(shape) for shape in PS_SHAPES)
    return _ps_params


def ps_pull() -> list[torch.Tensor]:
    """Return the server's parameter tensors (the trainer's pull)."""
    with _ps_lock:
        return list(_params())


def ps_push(grads: list[torch.Tensor]) -> int:
    """Apply one SGD step with ``grads`` under the lock; return the model's version."""
    global _ps_version
    with _ps_lock:
        for param, grad in zip(_params(), grads, strict=True):
            param.sub_(grad, alpha=PS_LR)
        _ps_version += 1
        return _ps_version


def fake_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the same shapes as ``params`` (cheap but real arithmetic)."""
    return [p.mul(1e-2) for p in params]


# -- distributed autograd ------------------------------------------------------------------

AUTOGRAD_LR = 0.01


def make_layer() -> nn.Linear:
    """One layer of the dist-autograd model, created on its owner by ``remote()``."""
    return nn.Linear(AUTOGRAD_FEATURES, AUTOGRAD_FEATURES)


def forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """Apply the layer behind RRef ``layer`` (run on its owner) to ``x``."""
    module: nn.Module = layer.local_value()
    out: torch.Tensor = module(x)
    return out


def parameter_rrefs(layer: Any) -> list[RRef[torch.Tensor]]:
    """asyncrpc RRefs of the parameters of the layer behind ``layer`` (run on its owner)."""
    module: nn.Module = layer.local_value()
    return [RRef(p) for p in module.parameters()]


def torch_parameter_rrefs(layer: Any) -> list[Any]:
    """torch.distributed.rpc RRefs of the layer's parameters (run on its owner)."""
    from torch.distributed.rpc import RRef as TorchRRef

    module: nn.Module = layer.local_value()
    return [TorchRRef(p) for p in module.parameters()]


def autograd_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed input and target the client trains on (the same for every system)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(AUTOGRAD_BATCH, AUTOGRAD_FEATURES, generator=gen)
    return x, torch.randn(AUTOGRAD_BATCH, AUTOGRAD_FEATURES, generator=gen)


# -- streams -------------------------------------------------------------------------------

# How far the stalled-consumer stream's producer got (read by the bench with an inline call).
_stream_progress: dict[str, int] = {}


def stream_items(n: int) -> Iterator[int]:
    """``n`` small items, from a plain generator (advanced on the callee's pool)."""
    yield from range(n)


def stream_tensors(n: int, floats: int) -> Iterator[torch.Tensor]:
    """``n`` float32 tensors of ``floats`` elements (the same one: its bytes are sent anew
    each time, as an echo's are)."""
    tensor = torch.ones(floats)
    for _ in range(n):
        yield tensor


def stream_fresh_tensors(tag: str, floats: int) -> Iterator[torch.Tensor]:
    """An endless stream of new tensors, noting how many were made under ``tag``."""
    made = 0
    while True:
        made += 1
        _stream_progress[tag] = made
        yield torch.ones(floats)


@inline
def stream_progress(tag: str) -> tuple[int, int]:
    """How many items the ``tag`` stream made, and the bytes of shared memory lent now."""
    from asyncrpc import get_metrics

    return _stream_progress.get(tag, 0), get_metrics()["shm_lent_bytes"]


async def stream_count(xs: AsyncIterator[Any]) -> int:
    """Reads a stream argument on the callee's loop; how many items it had."""
    count = 0
    async for _ in xs:
        count += 1
    return count


async def bidi_echo(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A bidirectional stream's function: each request back as its reply."""
    async for request in requests:
        yield request
