"""The distributed backward pass (layer L3), torch's FAST mode.

``backward`` runs the local graph from the roots on the calling worker; gradients that
reach a tensor received from another worker are sent back to that worker, which runs its
own graph on from the tensors it had sent, and so on. Each hop is an RPC that returns once
everything downstream of it is done, so the caller's ``backward`` returns when the whole
pass has finished. An error in any worker's graph reaches it as torch reports it, a
``RuntimeError`` saying ``Error on Node N: ...`` (a ``BackwardError``), that is also of the
error's original type; a worker that dies fails the pass with ``PeerLostError``.

A worker may run its graph several times in one pass (once per batch of gradients that
reaches it): backward is linear, so the per-context sums are the same as one run, and the
graph is kept (``retain_graph``) until the context is released.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from asyncrpc.autograd.context import AutogradContext, ContextTable
from asyncrpc.autograd.credit import FULL, PassCredit, first_of, split
from asyncrpc.autograd.feature import DistAutograd, context_table
from asyncrpc.errors import as_backward_error
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.futures import Future, chain, collect_all

__all__ = ["hand_back", "local_pass", "loop_pass", "pass_anywhere", "propagate"]

# Gradients for the tensors of one message: (sender rank, message id) -> by index.
Outgoing = dict[tuple[int, int], list[Any]]


def local_pass(
    context: AutogradContext, roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any],
    rank: int,
) -> Outgoing:  # fmt: skip
    """Run this worker's graph from ``roots``; returns the gradients to send back.

    Runs on a pool thread or the caller's (it is CPU work, and may run user code that
    blocks). Leaves received from other workers collect their gradients for sending; this
    worker's own leaves accumulate in ``context``.

    Raises:
        The error of the graph as torch reports it: also a ``BackwardError`` naming this
        worker (``Error on Node {rank}: ...``).
    """
    try:
        routed, _ = context.graph.run(roots, grad_outputs, context.received, rank)
    except Exception as exc:
        raise as_backward_error(exc, rank) from exc
    return _route(context, routed)


def loop_pass(
    context: AutogradContext, roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any],
    rank: int,
) -> Outgoing | None:  # fmt: skip
    """``local_pass`` run on the event loop, where the pass is small and runs no user code
    (``LocalGraph.run_on_loop``); None where it is not, with nothing run.

    Raises:
        As ``local_pass``.
    """
    try:
        routed = context.graph.run_on_loop(roots, grad_outputs)
    except Exception as exc:
        raise as_backward_error(exc, rank) from exc
    return None if routed is None else _route(context, routed)


async def pass_anywhere(
    agent: DistAutograd, table: ContextTable, context: AutogradContext,
    roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any],
) -> Outgoing:  # fmt: skip
    """The local pass, from the loop: run there where it may be (two thread wake-ups less
    than the pool's round trip), else on a pool thread."""
    outgoing = loop_pass(context, roots, grad_outputs, agent.rank)
    if outgoing is not None:
        table.count_pass_on_loop()
        return outgoing
    return await agent.loop.run_in_pool(  # type: ignore[no-any-return]
        functools.partial(local_pass, context, roots, grad_outputs, agent.rank)
    )


def _route(context: AutogradContext, routed: list[tuple[torch.Tensor, Any]]) -> Outgoing:
    # A gradient the graph handed to two leaves (a function returning one tensor twice)
    # is copied for each; any other is kept as it is, where its layout allows.
    handed = Counter(id(grad) for _, grad in routed)
    outgoing: Outgoing = {}
    for leaf, grad in routed:
        received = context.recvs.get(id(leaf))
        if received is None:
            context.accumulate(leaf, grad, shared=handed[id(grad)] > 1)
            continue
        sender, message_id, index, count = received
        slots = outgoing.setdefault((sender, message_id), [None] * count)
        slots[index] = grad if slots[index] is None else slots[index] + grad
    return outgoing


async def propagate(
    agent: DistAutograd,
    table: ContextTable,
    context: AutogradContext,
    roots: Sequence[torch.Tensor],
    grad_outputs: Sequence[Any],
) -> None:
    """Run the local pass as the root of a backward pass, then hand its gradients to the
    workers that sent the tensors; returns once the whole pass is over."""
    pass_id, over = table.credits.begin()
    try:
        outgoing = await pass_anywhere(agent, table, context, roots, grad_outputs)
        credit = PassCredit(agent.rank, pass_id, FULL)
        await first_of(over, hand_back(agent, table, context.id, outgoing, credit))
    finally:
        table.credits.end(pass_id)


async def grads_arrived(
    context_id: int,
    batches: list[tuple[int, list[Any]]],
    credit: PassCredit | None = None,
    caller: int = -1,
) -> int:
    """Runs on the worker that sent the tensors of each ``(message id, grads)`` batch: the
    backward goes on here, in one local pass for all of them.

    On the loop: the pass runs there where it is small and runs no user code, else on a
    pool thread; the hops further down are sent from the loop, and the reply waits for
    them. ``credit``: this hop's share of the pass's credit (``asyncrpc.autograd.credit``),
    split among the hops sent on, or handed back to the root when none are; ``caller``:
    the rank that sent this hop. Returns the credit the reply hands back (when the caller
    is the root), else 0.
    """
    agent, table = context_table()
    context = table.get(context_id)
    table.count_hop()
    roots, grad_outputs = [], []
    for message_id, grads in batches:
        _, tensors = context.sent(message_id)
        for tensor, grad in zip(tensors, grads, strict=True):
            if grad is not None:
                roots.append(tensor)
                grad_outputs.append(grad)
    outgoing = await pass_anywhere(agent, table, context, roots, grad_outputs)
    hops = by_sender(outgoing)
    shares = None if credit is None else split(credit, len(hops))
    if hops:
        await _send_hops(agent, table, context.id, hops, shares)
    if credit is None or shares is not None:
        return 0  # no credit, or it went on with the hops
    return _return_credit(agent, table, credit, caller)


def _return_credit(
    agent: DistAutograd, table: ContextTable, credit: PassCredit, caller: int
) -> int:
    """Hand ``credit`` back to its root: here, in the reply (returned), or in a call."""
    if credit.root == agent.rank:
        table.credits.hand_back(credit.pass_id, credit.amount)
        return 0
    if credit.root == caller:
        return credit.amount
    # Its own call: a lost one only costs the root its early finish (the replies end it).
    agent.calls.call_future(
        credit.root, credit_returned, (credit.pass_id, credit.amount), {}, UNSET_RPC_TIMEOUT
    )
    return 0


async def credit_returned(pass_id: int, amount: int) -> None:
    """Runs on the root of a backward pass: credit handed back by a worker whose pass
    sent no hops further (and that the root had not called itself)."""
    _, table = context_table()
    table.credits.calls += 1  # on the loop, the one thread that counts them
    table.credits.hand_back(pass_id, amount)


def by_sender(outgoing: Outgoing) -> dict[int, list[tuple[int, list[Any]]]]:
    """The gradients of a local pass grouped by the worker they go to: one hop each, however
    many messages of this context came from it (a model-parallel step that calls one worker
    for each micro-batch sends it one hop, not one per call)."""
    hops: dict[int, list[tuple[int, list[Any]]]] = {}
    for (sender, message_id), grads in outgoing.items():
        hops.setdefault(sender, []).append((message_id, grads))
    return hops


def hand_back(
    agent: DistAutograd, table: ContextTable, context_id: int, outgoing: Outgoing,
    credit: PassCredit | None = None,
) -> Future[None]:  # fmt: skip
    """Send the gradients to the workers that sent those tensors, one hop per worker (any
    thread, with no autograd context current), each with a share of ``credit``; the future
    completes when every hop has replied, and fails with the first hop's error. Credit the
    replies hand back (only the root is handed credit in replies) goes to ``table``."""
    hops = by_sender(outgoing)
    return _send_hops(
        agent, table, context_id, hops, None if credit is None else split(credit, len(hops))
    )


def _send_hops(
    agent: DistAutograd, table: ContextTable, context_id: int,
    hops: dict[int, list[tuple[int, list[Any]]]], shares: list[PassCredit] | None,
) -> Future[None]:  # fmt: skip
    """``hand_back`` of gradients already grouped by worker, with their credit shares
    (None: the hops carry none, as when it could not be split)."""
    shared: list[PassCredit | None] = [*shares] if shares else [None] * len(hops)
    calls = [
        agent.calls.call_future(
            sender, grads_arrived, (context_id, batches, share, agent.rank), {}, UNSET_RPC_TIMEOUT
        )
        for (sender, batches), share in zip(hops.items(), shared, strict=True)
    ]
    if not calls:
        done: Future[None] = Future()
        done.set_result(None)
        return done
    pass_id = None if shares is None else shares[0].pass_id
    return chain(collect_all(calls), functools.partial(_replied, table, pass_id))


def _replied(table: ContextTable, pass_id: int | None, done: Future[list[Future[Any]]]) -> None:
    returned = 0
    for hop in done.value():
        returned += hop.value() or 0  # raises the hop's error, with its original type
    if returned and pass_id is not None:
        table.credits.hand_back(pass_id, returned)
