"""Distributed autograd with torch's names (layer L3): ``from asyncrpc import autograd as
dist_autograd`` where torch programs ``import torch.distributed.autograd as dist_autograd``.

``with autograd.context() as context_id:`` (``async with`` in async code) opens a context;
RPCs made inside it record their tensors requiring grad on both sides, and
``backward(context_id, [loss])`` (``await backward_async(...)``) sends gradients back
across every recorded edge. Gradients accumulate per context on the worker that owns the
tensors (``get_gradients``), never into ``.grad``. Leaving the block releases the context
on every worker it reached.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from asyncrpc.autograd.context import AutogradContext, current_context_id
from asyncrpc.autograd.credit import FULL, PassCredit, first_of
from asyncrpc.autograd.engine import Hop, local_pass, propagate, root_onward
from asyncrpc.autograd.feature import DistAutograd, context_table
from asyncrpc.autograd.hook import AutogradHook
from asyncrpc.errors import AutogradContextError, BlockingCallError
from asyncrpc.runtime.futures import Future

__all__ = [
    "AutogradHook",
    "backward",
    "backward_async",
    "context",
    "current_context",
    "get_gradients",
]


class context:
    """A distributed autograd context: ``with`` or ``async with``; yields its id.

    Contexts do not nest: opening one where one is active (a block inside a block, or a
    function run by an RPC made in a context) raises ``AutogradContextError``, a
    ``RuntimeError``, as torch does.

    Leaving it releases the context on every worker it reached, in the background (as
    torch's does): the recorded graphs and gradients are dropped there soon after.
    """

    def __init__(self) -> None:
        self._token: Any = None
        self._id = 0

    def _open(self) -> int:
        if current_context_id.get() is not None:
            # torch's rule and words: one context per thread (here: per thread or task).
            raise AutogradContextError(
                "Already have an autograd context id for this thread: distributed autograd "
                f"contexts do not nest (this code runs in context {current_context_id.get()})"
            )
        agent, table = context_table()
        self._id = table.create(agent.rank).id
        self._token = current_context_id.set(self._id)
        return self._id

    def __enter__(self) -> int:
        return self._open()

    def _close(self) -> None:
        current_context_id.reset(self._token)
        autograd, _ = context_table()
        autograd.releases.left(self._id)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self._close()

    async def __aenter__(self) -> int:
        return self._open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self._close()


def current_context() -> int | None:
    """The id of the context the calling code runs in, or None.

    Returns:
        The id of the ``context()`` block this thread or task runs in (on a callee: of
        the context the caller's RPC was made in), None outside any.
    """
    return current_context_id.get()


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated on this worker in context ``context_id``, by tensor.

    Args:
        context_id: a context this worker took part in (the id ``context()`` yielded on
            the worker that opened it, passed to the others).

    Returns:
        A dict from each tensor of this worker that got a gradient in that context to
        the gradient accumulated so far; ``.grad`` is never touched.

    Raises:
        AutogradContextError: this worker has no such context.
    """
    _, table = context_table()
    return table.get(context_id).gradients()


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (torch's ``dist_autograd.backward``).

    Blocks until every worker the gradients reach has finished.

    Args:
        context_id: the context the forward pass ran in (on this worker).
        roots: scalar tensors requiring grad (usually the loss).
        retain_graph: allow another backward in this context; without it, a second one
            raises ``RuntimeError`` as torch's does.

    Raises:
        AutogradContextError: no such context on a worker the pass reaches.
        BlockingCallError: called on the agent's loop thread (use ``backward_async``).
        BackwardError: a worker's part of the pass failed; a ``RuntimeError`` saying
            ``Error on Node N: ...`` as torch's, and also of the original error's type where
            the two pair (``except KeyError`` still catches a ``KeyError``).
        PeerLostError: a worker died meanwhile.
    """
    agent, table = context_table()
    if threading.get_ident() == agent.loop.thread_id:
        raise BlockingCallError("backward() would block the agent's loop; use backward_async()")
    # The calling thread waits anyway: it runs this worker's part of the pass itself (no
    # hand-off to the pool and back), hands the gradients on (on its own lane where it may:
    # engine.root_onward), and while it waits runs the hops of the pass that come back
    # here (asyncrpc.autograd.roots).
    context = table.get(context_id)
    grads = _start(context, context_id, roots, retain_graph)
    pass_id = table.credits.begin()
    table.root_threads.open(pass_id)
    token = current_context_id.set(None)  # the gradient hops are not part of the context
    try:
        outgoing = local_pass(context, list(roots), grads, agent.rank)
        root = Hop(agent, table, context, PassCredit(agent.rank, pass_id, FULL))
        replies = root_onward(root, outgoing)
        if isinstance(replies, Future):
            # Over when all its credit is back (or every reply, with the first error).
            done = first_of(table.credits.over(pass_id), replies)
            table.root_threads.serve(pass_id, done)
            done.value()  # raises the pass's error
        else:  # over already: this thread ran all that came back (its one lane hop's)
            table.root_threads.finish(pass_id)
    finally:
        table.root_threads.close(pass_id)
        current_context_id.reset(token)
        table.credits.end(pass_id)


async def backward_async(
    context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False
) -> None:
    """``backward`` for async code, from any loop.

    Cancelling the wait does not stop the pass (the workers finish it); the context stays
    usable.

    Args:
        context_id: the context the forward pass ran in (on this worker).
        roots: scalar tensors requiring grad (usually the loss).
        retain_graph: allow another backward in this context.

    Raises:
        AutogradContextError: no such context on a worker the pass reaches.
        BackwardError: a worker's part of the pass failed (as for ``backward``).
        PeerLostError: a worker died meanwhile.
    """
    agent, _ = context_table()
    await _on_agent_loop(agent, _backward(agent, context_id, roots, retain_graph))


async def _on_agent_loop(agent: DistAutograd, coro: Any) -> Any:
    # Always a task of its own: it must not see (or change) the caller's current context.
    loop = agent.loop.aio
    if asyncio.get_running_loop() is loop:
        return await loop.create_task(coro)
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def _backward(
    agent: DistAutograd, context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool
) -> None:
    current_context_id.set(None)  # the gradient hops are not part of the context
    _, table = context_table()
    context = table.get(context_id)
    grads = _start(context, context_id, roots, retain_graph)
    await propagate(agent, table, context, list(roots), grads)


def _start(
    context: AutogradContext, context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool
) -> list[torch.Tensor]:
    """Check the roots of a pass and mark them used; returns their initial gradients."""
    for root in roots:
        if not isinstance(root, torch.Tensor) or not root.requires_grad:
            raise ValueError("backward roots must be tensors that require grad")
        if id(root) in context.released_roots:
            raise RuntimeError(
                "trying to backward through the graph a second time in autograd context "
                f"{context_id}: pass retain_graph=True to the first backward"
            )
    # The graph itself is kept until the context is released (other hops may still need
    # it); what torch's rule forbids is a second pass from the same root.
    if not retain_graph:
        context.released_roots.update((id(root), root) for root in roots)
    return [torch.ones_like(root) for root in roots]
