"""Client-side measurement loops of the RPC systems, and the statistics they report.

Part of ``asyncrpc.bench``. The blocking loops take the RPC module as an argument
(``torch.distributed.rpc`` or ``asyncrpc``: same calls, same code); the ``await`` loops are
asyncrpc's asyncio-native style. Every loop runs for a given time with a minimum count.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from asyncrpc.bench import workloads
from asyncrpc.bench.config import AUTOGRAD_OWNERS, Item
from asyncrpc.bench.stats import echo_stats, latency_stats, min_echo_iterations, throughput_stats

__all__ = [
    "Unavailable",
    "autograd_train",
    "resolve_function",
    "run_item_await",
    "run_item_blocking",
]

MIN_LATENCY_SAMPLES = 20
MIN_AUTOGRAD_STEPS = 5
_clock = time.perf_counter_ns


class Unavailable(Exception):
    """This system cannot run this item (e.g. ``asyncrpc.remote`` does not exist yet)."""


# -- what to call --------------------------------------------------------------------------


def resolve_function(fn: str, system: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The remote function and arguments of item function ``fn`` for ``system``."""
    if fn == "sync":
        return workloads.noop, ()
    if fn == "inline":
        return (workloads.inline_noop if system == "asyncrpc" else workloads.noop), ()
    if fn == "async":
        # torch cannot run coroutines: its equivalent is an @async_execution function.
        return (workloads.async_noop if system == "asyncrpc" else workloads.torch_async_noop), ()
    if fn == "builtin":
        return torch.add, (torch.ones(2), torch.ones(2))
    if fn == "value":
        return workloads.value, ()
    raise ValueError(f"unknown function {fn!r}")


def _remote(rpc: Any) -> Callable[..., Any]:
    remote = getattr(rpc, "remote", None)
    if remote is None:
        raise Unavailable(f"{rpc.__name__}.remote does not exist")
    return remote  # type: ignore[no-any-return]


# -- blocking loops (torch, and asyncrpc's sync style) --------------------------------------


def blocking_latency(rpc: Any, to: str, fn: Any, args: tuple[Any, ...], duration: float) -> Any:
    rpc_sync, samples = rpc.rpc_sync, []
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        rpc_sync(to, fn, args)
        t1 = _clock()
        samples.append(t1 - t0)
        if t1 >= end and len(samples) >= MIN_LATENCY_SAMPLES:
            return latency_stats(samples)


def blocking_window(
    rpc: Any, to: str, fn: Any, args: tuple[Any, ...], inflight: int, duration: float
) -> Any:
    """``inflight`` calls kept in flight with ``rpc_async``, waited for oldest first."""
    rpc_async, window, done = rpc.rpc_async, deque[Any](), 0
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        if len(window) >= inflight:
            window.popleft().wait()
            done += 1
        window.append(rpc_async(to, fn, args))
    while window:
        window.popleft().wait()
        done += 1
    return throughput_stats(done, time.perf_counter() - start)


def callback_window(
    rpc: Any, to: str, fn: Any, args: tuple[Any, ...], inflight: int, duration: float
) -> Any:
    """``inflight`` calls kept in flight with ``rpc_async``, each ended by a done-callback
    (registered from this plain thread: asyncrpc runs it on its callback pool, torch on the
    thread that completed the future)."""
    rpc_async, slots, done = rpc.rpc_async, threading.Semaphore(inflight), [0]
    errors: list[BaseException] = []

    def finished(fut: Any) -> None:
        try:
            fut.value()
        except BaseException as exc:  # reported below, on the measuring thread
            errors.append(exc)
        done[0] += 1  # one callback at a time per slot: the GIL makes += safe enough here
        slots.release()

    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        if not slots.acquire(timeout=60):
            raise RuntimeError("no callback ran for 60 s")
        rpc_async(to, fn, args).add_done_callback(finished)
    for _ in range(inflight):  # every call still in flight ends
        if not slots.acquire(timeout=60):
            raise RuntimeError("no callback ran for 60 s")
    if errors:
        raise errors[0]
    return throughput_stats(done[0], time.perf_counter() - start)


def blocking_echo(rpc: Any, to: str, tensor: torch.Tensor, duration: float) -> Any:
    times, size = [], tensor.numel() * tensor.element_size()
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        out = rpc.rpc_sync(to, workloads.echo, (tensor,))
        t1 = _clock()
        if out.numel() != tensor.numel():
            raise RuntimeError(f"echo returned {out.numel()} elements, sent {tensor.numel()}")
        times.append(t1 - t0)
        if t1 >= end and len(times) >= min_echo_iterations(size):
            return echo_stats(size, times)


def blocking_remote(rpc: Any, to: str, duration: float) -> Any:
    remote, samples = _remote(rpc), []
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        got = remote(to, workloads.value).to_here()
        t1 = _clock()
        if got != 42:
            raise RuntimeError(f"to_here() returned {got!r}")
        samples.append(t1 - t0)
        if t1 >= end and len(samples) >= MIN_LATENCY_SAMPLES:
            return latency_stats(samples)


def ps_train(rpc: Any, to: str, duration: float) -> dict[str, float]:
    """One trainer: pull the parameters, compute fake gradients, push them; repeat."""
    updates = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        params = rpc.rpc_sync(to, workloads.ps_pull)
        rpc.rpc_sync(to, workloads.ps_push, (workloads.fake_grads(params),))
        updates += 1
    return {"updates": updates, "elapsed_s": time.perf_counter() - start}


def _autograd_api(system: str) -> tuple[Any, Any, Callable[..., Any]]:
    """``system``'s distributed autograd module, DistributedOptimizer and parameter-RRef maker
    (the same names torch users import; asyncrpc's are drop-ins)."""
    if system == "asyncrpc":
        from asyncrpc import autograd
        from asyncrpc.optim import DistributedOptimizer

        return autograd, DistributedOptimizer, workloads.parameter_rrefs
    import torch.distributed.autograd as torch_autograd
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    return torch_autograd, TorchDistributedOptimizer, workloads.torch_parameter_rrefs


def _autograd_model(rpc: Any, param_rrefs: Callable[..., Any]) -> tuple[list[Any], list[Any]]:
    """A fresh layer on each of ``AUTOGRAD_OWNERS`` (RRefs), and the RRefs of all their
    parameters, fetched from the owners."""
    layers = [rpc.remote(owner, workloads.make_layer) for owner in AUTOGRAD_OWNERS]
    params = []
    for owner, layer in zip(AUTOGRAD_OWNERS, layers, strict=True):
        params += rpc.rpc_sync(owner, param_rrefs, (layer,))
    return layers, params


def _autograd_step(
    rpc: Any, dist_autograd: Any, optimizer: Any, layers: list[Any], batch: tuple[Any, Any]
) -> float:
    """One training step, as torch's distributed training tutorials write it; its loss."""
    (owner_a, owner_b), (layer_a, layer_b), (x, target) = AUTOGRAD_OWNERS, layers, batch
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync(owner_a, workloads.forward, (layer_a, x))
        y = rpc.rpc_sync(owner_b, workloads.forward, (layer_b, torch.relu(h)))
        loss = (y - target).pow(2).mean()
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return float(loss.item())


def autograd_train(rpc: Any, system: str, duration: float) -> dict[str, float]:
    """Train a fresh two-layer model, one layer on each of ``AUTOGRAD_OWNERS``; count steps.

    A step is the forward through both layers (one ``rpc_sync`` each), the loss on the
    client, ``dist_autograd.backward`` and ``DistributedOptimizer.step``. Building the model
    is not timed (``setup_s`` reports it).
    """
    dist_autograd, optimizer_class, param_rrefs = _autograd_api(system)
    setup_start = time.perf_counter()
    layers, params = _autograd_model(rpc, param_rrefs)
    optimizer = optimizer_class(torch.optim.SGD, params, lr=workloads.AUTOGRAD_LR)
    batch = workloads.autograd_batch()
    start = time.perf_counter()
    losses = [_autograd_step(rpc, dist_autograd, optimizer, layers, batch)]
    while len(losses) < MIN_AUTOGRAD_STEPS or time.perf_counter() - start < duration:
        losses.append(_autograd_step(rpc, dist_autograd, optimizer, layers, batch))
    elapsed = time.perf_counter() - start
    # A loss that did not go down means the gradients or the step never reached the owners.
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"training did not lower the loss ({losses[0]} -> {losses[-1]})")
    return {
        "steps_per_s": len(losses) / elapsed,
        "steps": len(losses),
        "elapsed_s": elapsed,
        "loss": losses[-1],
        "setup_s": start - setup_start,
    }


def run_item_blocking(
    rpc: Any, system: str, item: Item, to: str, duration: float, tensors: dict[int, torch.Tensor]
) -> Any:
    """Run one item with the blocking API of ``rpc``; return its statistics."""
    if item.kind == "echo":
        return blocking_echo(rpc, to, tensors[item.size], duration)
    if item.kind == "remote":
        return blocking_remote(rpc, to, duration)
    if item.kind == "ps":
        return ps_train(rpc, to, duration)
    if item.kind == "dist-autograd":
        return autograd_train(rpc, system, duration)
    fn, args = resolve_function(item.fn, system)
    if item.kind == "latency":
        return blocking_latency(rpc, to, fn, args, duration)
    window = callback_window if item.style == "callbacks" else blocking_window
    return window(rpc, to, fn, args, item.inflight, duration)


# -- asyncio loops (asyncrpc's native style) ------------------------------------------------


async def await_latency(to: str, fn: Any, args: tuple[Any, ...], duration: float) -> Any:
    import asyncrpc

    call, samples = asyncrpc.call, []
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        await call(to, fn, *args)
        t1 = _clock()
        samples.append(t1 - t0)
        if t1 >= end and len(samples) >= MIN_LATENCY_SAMPLES:
            return latency_stats(samples)


async def await_throughput(
    to: str, fn: Any, args: tuple[Any, ...], inflight: int, duration: float
) -> Any:
    """``inflight`` tasks, each awaiting one call after another until the time is up."""
    import asyncrpc

    call, done = asyncrpc.call, 0
    start = time.perf_counter()
    end = start + duration

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call(to, fn, *args)
            done += 1

    await asyncio.gather(*(caller() for _ in range(inflight)))
    return throughput_stats(done, time.perf_counter() - start)


async def await_echo(to: str, tensor: torch.Tensor, duration: float) -> Any:
    import asyncrpc

    times, size = [], tensor.numel() * tensor.element_size()
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        out = await asyncrpc.call(to, workloads.echo, tensor)
        t1 = _clock()
        if out.numel() != tensor.numel():
            raise RuntimeError(f"echo returned {out.numel()} elements, sent {tensor.numel()}")
        times.append(t1 - t0)
        if t1 >= end and len(times) >= min_echo_iterations(size):
            return echo_stats(size, times)


async def await_remote(to: str, duration: float) -> Any:
    import asyncrpc

    remote, samples = _remote(asyncrpc), []
    end = _clock() + int(duration * 1e9)
    while True:
        t0 = _clock()
        rref = remote(to, workloads.value)
        # asyncrpc's asyncio-native fetch is to_here_future(); to_here() blocks.
        fetch = getattr(rref, "to_here_future", None)
        got = await fetch() if fetch is not None else rref.to_here()
        if inspect.isawaitable(got):
            got = await got
        t1 = _clock()
        if got != 42:
            raise RuntimeError(f"to_here() returned {got!r}")
        samples.append(t1 - t0)
        if t1 >= end and len(samples) >= MIN_LATENCY_SAMPLES:
            return latency_stats(samples)


async def run_item_await(
    item: Item, to: str, duration: float, tensors: dict[int, torch.Tensor]
) -> Any:
    """Run one asyncrpc item on the running loop (the agent's); blocking styles in a thread."""
    import asyncrpc

    if item.style != "await":
        return await asyncio.to_thread(
            run_item_blocking, asyncrpc, "asyncrpc", item, to, duration, tensors
        )
    if item.kind == "echo":
        return await await_echo(to, tensors[item.size], duration)
    if item.kind == "remote":
        return await await_remote(to, duration)
    fn, args = resolve_function(item.fn, "asyncrpc")
    if item.kind == "latency":
        return await await_latency(to, fn, args, duration)
    return await await_throughput(to, fn, args, item.inflight, duration)
