"""``DistributedOptimizer`` with torch's names and signature (layer L4).

``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` builds one local
optimizer on each worker that owns some of the parameters; ``step(context_id)`` steps them
all concurrently, each with the gradients its worker accumulated in that distributed
autograd context.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from asyncrpc.api import remote, rpc_async
from asyncrpc.autograd import get_gradients
from asyncrpc.autograd.feature import context_table
from asyncrpc.errors import BlockingCallError
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.rref.handle import RRef, current_rrefs
from asyncrpc.runtime.futures import Future, collect_all
from asyncrpc.runtime.intraop import one_thread

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

        Args:
            context_id: the distributed autograd context whose gradients to apply.

        Raises:
            BlockingCallError: called on the agent's loop thread (use ``step_future``).
            Exception: the first owner's error (with its original type), once all have
                finished.
        """
        if not current_rrefs().off_loop():
            raise BlockingCallError("step() would block the agent's loop; use step_future()")
        # The calling thread waits anyway: it writes every other owner's step on its lane
        # to that owner, where it has one (the owners' lane threads step them, all at
        # once), steps this worker's own optimizer itself meanwhile (no call to itself
        # through the loop), then reads the replies itself: no hand-off to the loop and
        # back. A step that takes no lane goes the loop's way (on the owner's loop).
        optimizers = self._optimizers
        calls = context_table()[0].calls
        started = {
            i: _start_step(optimizer, context_id)
            for i, optimizer in enumerate(optimizers)
            if not optimizer.is_owner()
        }
        outcomes: dict[int, BaseException | None] = {}
        for i, optimizer in enumerate(optimizers):
            if optimizer.is_owner():
                outcomes[i] = _outcome(_step_own, optimizer, context_id)
        for i, call in started.items():
            outcomes[i] = (
                call if isinstance(call, BaseException) else _outcome(calls.finish_sync, call)
            )
        for i in range(len(optimizers)):  # the first failure in list order, as torch's
            error = outcomes[i]
            if error is not None:
                raise error

    def step_future(self, context_id: int) -> list[Future[None]]:
        """Start the steps on every owner, without blocking.

        Args:
            context_id: the distributed autograd context whose gradients to apply.

        Returns:
            One ``Future`` per owner (``await`` them, or ``wait()``); each fails with
            that owner's error, with its original type.
        """
        # By RRef id: pickling the RRef itself would fork it (and acknowledge the fork)
        # on every step. This object holds the RRefs, so the owners keep the optimizers.
        return [_step_future(optimizer, context_id) for optimizer in self._optimizers]


class LocalOptimizer:
    """The optimizer of the parameters one worker owns (runs on that worker)."""

    # One lock for every LocalOptimizer of this process, as torch's. Each trainer's
    # DistributedOptimizer builds its own LocalOptimizer here, often over the same
    # parameters (a parameter server): a step sets each parameter's .grad to its own
    # context's gradient, then steps, so two steps at once on shared parameters would
    # read each other's gradients or lose an update (a wrong result, no error).
    _step_lock = threading.Lock()
    steps_on_loop = 0  # steps of this process run on the event loop (held by _step_lock)
    steps_here = 0  # steps run on the thread that asked for them (held by _step_lock)

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[RRef[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [rref.local_value() for rref in params_rref]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

        # Whether a step may run on the event loop (see step_on_loop): decided once, on
        # what cannot change after construction.
        self._small = type(self.optimizer) is optimizer_class and _small_step(
            optimizer_class, self.params
        )

    def step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with LocalOptimizer._step_lock:
            self._step_with(grads)

    def step_here(self, context_id: int) -> None:
        """``step`` on the calling thread, which waits for it anyway: the thread in
        ``DistributedOptimizer.step`` (this worker's own optimizer), or the thread of a
        lane the step came on. A small step runs its BLAS calls on this thread alone,
        as on the loop."""
        grads = get_gradients(context_id)
        with LocalOptimizer._step_lock:
            if self._small:
                with one_thread():
                    self._step_with(grads)
            else:
                self._step_with(grads)
            LocalOptimizer.steps_here += 1

    def step_on_loop(self, context_id: int) -> bool:
        """Step here, on the event loop, where that cannot hold it up or run user code; False
        (nothing done) where it might: then ``step`` it on a pool thread.

        On the loop: one of torch's own optimizers (not a subclass), over at most
        ``LOOP_STEP_MAX_ELEMENTS`` elements on the CPU, with no step hooks; a context whose
        passes ran on torch's engine (DDP) and a step lock another step holds go to the
        pool (the loop never waits on a lock).
        """
        if not self._small or _has_step_hooks(self.optimizer):
            return False
        _, table = context_table()
        context = table.get(context_id)
        if context.graph.on_torch_engine:
            return False
        if not LocalOptimizer._step_lock.acquire(blocking=False):
            return False
        try:
            with one_thread():  # the loop must not wait at a parallel region's barrier
                self._step_with(context.gradients())
            LocalOptimizer.steps_on_loop += 1
        finally:
            LocalOptimizer._step_lock.release()
        return True

    def _step_with(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        for param in self.params:
            param.grad = grads.get(param)
        try:
            self.optimizer.step()
        finally:
            for param in self.params:
                param.grad = None


# A step on the loop saves the pool's round trip (two thread wake-ups) on each owner; torch's
# optimizers cost ~1-5 ns per element, so this many stay well under a millisecond.
LOOP_STEP_MAX_ELEMENTS = 1 << 16


def _small_step(optimizer_class: type[Any], params: Sequence[torch.Tensor]) -> bool:
    return (
        optimizer_class.__module__.startswith("torch.optim.")
        and all(isinstance(p, torch.Tensor) and p.is_cpu for p in params)
        and sum(p.numel() for p in params) <= LOOP_STEP_MAX_ELEMENTS
    )


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    # Hooks are user code: it may block, so it runs on a pool thread.
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


async def _step(optimizer_id: tuple[int, int], context_id: int) -> None:
    # On the loop: the remote() that builds the optimizer may still be running.
    optimizer: LocalOptimizer = await current_rrefs().forks.owned_value(*optimizer_id)
    if not optimizer.step_on_loop(context_id):
        await current_rrefs().run_in_pool(functools.partial(optimizer.step, context_id))


def _step_here(optimizer_id: tuple[int, int], context_id: int) -> None:
    # A plain function: on the owner's lane thread, or on a pool thread where the call
    # came the loop's way (it may wait there for the remote() that builds the optimizer).
    optimizer: LocalOptimizer = current_rrefs().forks.owned_value(*optimizer_id).wait()
    optimizer.step_here(context_id)


def _step_own(optimizer: RRef[LocalOptimizer], context_id: int) -> None:
    optimizer.local_value().step_here(context_id)


def _step_future(optimizer: RRef[LocalOptimizer], context_id: int) -> Future[None]:
    return rpc_async(optimizer.owner_name(), _step, args=(optimizer.id(), context_id))


def _start_step(optimizer: RRef[LocalOptimizer], context_id: int) -> Any:
    """Start ``optimizer``'s step on its owner, on this thread's lane there where it may
    (the owner's lane thread steps), else the loop's way (``_step``, on the owner's loop);
    what ``finish_sync`` takes, or the error that kept it from starting."""
    calls = context_table()[0].calls
    args = (optimizer.id(), context_id)
    try:
        return calls.start_sync(optimizer.owner(), _step_here, args, UNSET_RPC_TIMEOUT, _step)
    except Exception as exc:  # raised by step() once every owner has finished
        return exc


def _outcome(fn: Callable[..., Any], *args: Any) -> BaseException | None:
    """Run ``fn(*args)``; the ``Exception`` it raised, or None."""
    try:
        fn(*args)
    except Exception as exc:  # raised by step() once every owner has finished
        return exc
    return None


def _wait_every(futures: list[Future[Any]]) -> None:
    """Wait for every future, then raise the first failure in list order (torch's
    DistributedOptimizer waits for all its owners too, where wait_all would not)."""
    for done in collect_all(futures).wait():
        done.value()
