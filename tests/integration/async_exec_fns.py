"""``@async_execution`` functions returning ``then`` chains (importable by every process).

``then`` on a ``torch.futures.Future`` returns a bare ``torch._C.Future``: torch accepts it
as an ``@async_execution`` result, and so must asyncrpc.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import async_execution

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # torch's rpc package warns without numpy
    from torch.distributed.rpc.functions import async_execution as torch_async_execution

_lock = threading.Lock()
# Futures a test completes with a later call, by tag: the call that makes the `then`
# chain and the call that completes it may run in either order on the callee's pool.
_torch_futures: dict[str, torch.futures.Future[Any]] = {}
_our_futures: dict[str, asyncrpc.Future[Any]] = {}


def _torch_future(tag: str) -> torch.futures.Future[Any]:
    with _lock:
        return _torch_futures.setdefault(tag, torch.futures.Future())


def _our_future(tag: str) -> asyncrpc.Future[Any]:
    with _lock:
        return _our_futures.setdefault(tag, asyncrpc.Future())


@torch_async_execution
def torch_then(tag: str) -> Any:
    """torch's decorator, a chain of two ``then`` on a torch future completed later."""
    return _torch_future(tag).then(lambda f: f.wait() + 1).then(lambda f: f.wait() * 2)


@async_execution
def torch_then_ours(tag: str) -> Any:
    """asyncrpc's decorator, the same chain."""
    return _torch_future(tag).then(lambda f: f.wait() + 1).then(lambda f: f.wait() * 2)


@async_execution
def torch_then_raises(tag: str) -> Any:
    return _torch_future(tag).then(_raise_key_error)


def _raise_key_error(done: Any) -> None:
    raise KeyError(f"after {done.wait()}")


def complete_torch(tag: str, value: Any) -> None:
    _torch_future(tag).set_result(value)


@async_execution
def ours_then(tag: str) -> asyncrpc.Future[Any]:
    """An ``asyncrpc.Future.then`` chain completed later."""
    return _our_future(tag).then(lambda f: f.wait() + 1).then(lambda f: f.wait() * 2)


def complete_ours(tag: str, value: Any) -> None:
    _our_future(tag).set_result(value)


@async_execution
def returns_no_future(value: int) -> int:
    return value


class Batcher:
    """pytorch/examples' batch RL agent in small: each caller writes its state into a
    batch and gets ``then`` of the batch's torch future; the call that fills the batch
    completes it, answering every caller at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pending = size
        self.lock = threading.Lock()
        self.states = torch.zeros(size)
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    @staticmethod
    @torch_async_execution
    def select(batcher: asyncrpc.RRef[Batcher], slot: int, state: float) -> Any:
        self = batcher.local_value()
        self.states[slot] = state
        action = self.future.then(lambda f: f.wait()[slot].item())
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.pending = self.size
                full, self.future = self.future, torch.futures.Future()
                full.set_result(self.states * 10)
        return action

    @async_execution
    def plus_one_later(self, value: int) -> Any:
        """A method, called through ``rref.rpc_sync()``."""
        fut: torch.futures.Future[int] = torch.futures.Future()
        fut.set_result(value)
        return fut.then(lambda f: f.wait() + 1)
