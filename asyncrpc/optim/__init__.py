"""``DistributedOptimizer`` with torch's names and signature (layer L4).

``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` builds one local
optimizer on each worker that owns some of the parameters; ``step(context_id)`` steps them
all concurrently, each with the gradients its worker accumulated in that distributed
autograd context.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from asyncrpc.api import remote, rpc_async
from asyncrpc.autograd import get_gradients
from asyncrpc.rref.handle import RRef, current_rrefs
from asyncrpc.runtime.future import Future, collect_all

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """Steps the parameters behind ``params_rref`` on their owners (torch's class).

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` class, built on each owner as
            ``optimizer_class(local_params, *args, **kwargs)``.
        params_rref: RRefs of the parameters, on any workers (``RRef(param)`` on the
            owner, or ``module.parameter_rrefs()``-style lists from remote modules).
        *args, **kwargs: passed to ``optimizer_class``.

    Raises:
        The errors of ``remote``, and the error of an optimizer that fails to build on
        its owner (with its original type): like torch's, the constructor waits until
        every owner has built its optimizer.
    """

    def __init__(
        self, optimizer_class: type[torch.optim.Optimizer], params_rref: Sequence[RRef[Any]],
        *args: Any, **kwargs: Any,
    ) -> None:  # fmt: skip
        by_owner: dict[str, list[RRef[Any]]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        self._optimizers: list[RRef[LocalOptimizer]] = [
            remote(owner, LocalOptimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()
        ]
        _wait_every([optimizer._get_future() for optimizer in self._optimizers])

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id``; blocks.

        Raises:
            The first owner's error (with its original type), once all have finished.
        """
        _wait_every(self.step_future(context_id))

    def step_future(self, context_id: int) -> list[Future[None]]:
        """Start the steps on every owner; returns their futures (await or wait them)."""
        # By RRef id: pickling the RRef itself would fork it (and acknowledge the fork)
        # on every step. This object holds the RRefs, so the owners keep the optimizers.
        return [
            rpc_async(optimizer.owner_name(), _step, args=(optimizer.id(), context_id))
            for optimizer in self._optimizers
        ]


class LocalOptimizer:
    """The optimizer of the parameters one worker owns (runs on that worker)."""

    # One lock for every LocalOptimizer of this process, as torch's. Each trainer's
    # DistributedOptimizer builds its own LocalOptimizer here, often over the same
    # parameters (a parameter server): a step sets each parameter's .grad to its own
    # context's gradient, then steps, so two steps at once on shared parameters would
    # read each other's gradients or lose an update (a wrong result, no error).
    _step_lock = threading.Lock()

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[RRef[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [rref.local_value() for rref in params_rref]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with LocalOptimizer._step_lock:
            for param in self.params:
                param.grad = grads.get(param)
            self.optimizer.step()
            for param in self.params:
                param.grad = None


def _step(optimizer_id: tuple[int, int], context_id: int) -> None:
    # wait(): the remote() that builds it may still be running (on a pool thread here).
    optimizer: LocalOptimizer = current_rrefs().owned_value(*optimizer_id).wait()
    optimizer.step(context_id)


def _wait_every(futures: list[Future[Any]]) -> None:
    """Wait for every future, then raise the first failure in list order (torch's
    DistributedOptimizer waits for all its owners too, where wait_all would not)."""
    for done in collect_all(futures).wait():
        done.value()
