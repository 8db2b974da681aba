"""The distributed backward pass (layer L3), torch's FAST mode.

``backward`` runs the local graph from the roots on the calling worker; gradients that
reach a tensor received from another worker are sent back to that worker, which runs its
own graph on from the tensors it had sent, and so on. Each hop is an RPC that returns once
everything downstream of it is done, so the caller's ``backward`` returns when the whole
pass has finished (or earlier, on credit: ``credit.py``). Gradients that only go back to
the worker that sent a hop ride in the hop's reply; that worker carries on with them as
with a hop of its own. An error in any worker's graph reaches it as torch reports it, a
``RuntimeError`` saying ``Error on Node N: ...`` (a ``BackwardError``), that is also of the
error's original type; a worker that dies fails the pass with ``PeerLostError``.

A worker may run its graph several times in one pass (once per batch of gradients that
reaches it): backward is linear, so the per-context sums are the same as one run, and the
graph is kept (``retain_graph``) until the context is released.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from asyncrpc.autograd.context import AutogradContext, ContextTable
from asyncrpc.autograd.credit import FULL, PassCredit, first_of, split
from asyncrpc.autograd.feature import DistAutograd, context_table
from asyncrpc.autograd.graph import Plan, plan_holds, runs_after_reply
from asyncrpc.autograd.hopwire import dump_hop, dump_hop_reply, load_hop, load_hop_reply
from asyncrpc.errors import as_backward_error
from asyncrpc.functions import async_execution, inline
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT
from asyncrpc.runtime.calls.outbox import NOT_ON_LANE
from asyncrpc.runtime.futures import (
    Future,
    add_hook,
    collect_all,
    copy_outcome,
    try_set_exception,
    try_set_result,
)

__all__ = [
    "HOP_CALL",
    "Hop",
    "grads_arrived",
    "grads_here",
    "local_pass",
    "loop_pass",
    "pass_anywhere",
    "propagate",
    "root_onward",
]

# Gradients for the tensors of one message: (sender rank, message id) -> by index.
Outgoing = dict[tuple[int, int], list[Any]]


def local_pass(
    context: AutogradContext, roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any],
    rank: int, defer: bool = False, planned: Plan | None = None,
) -> Outgoing:  # fmt: skip
    """Run this worker's graph from ``roots``; returns the gradients to send back.

    Runs on a pool thread or the caller's (it is CPU work, and may run user code that
    blocks). Leaves received from other workers collect their gradients for sending; this
    worker's own leaves accumulate in ``context`` (``defer``: once ``context.settle()``
    runs, or whatever reads the context's gradients first). ``planned``: the pass planned
    ahead for ``roots`` (``AutogradContext.plan_sent``), if any.

    Raises:
        The error of the graph as torch reports it: also a ``BackwardError`` naming this
        worker (``Error on Node {rank}: ...``).
    """
    try:
        routed, _ = context.graph.run(roots, grad_outputs, context.received, rank, planned)
    except Exception as exc:
        raise as_backward_error(exc, rank) from exc
    return _route(context, routed, defer)


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


def _route(
    context: AutogradContext, routed: list[tuple[torch.Tensor, Any]], defer: bool = False
) -> Outgoing:
    # A gradient the graph handed to two leaves (a function returning one tensor twice)
    # is copied for each; any other is kept as it is, where its layout allows.
    handed = _handed_twice(routed)
    outgoing: Outgoing = {}
    own: list[tuple[torch.Tensor, Any, bool]] = []
    for leaf, grad in routed:
        received = context.recvs.get(id(leaf))
        if received is None:
            own.append((leaf, grad, id(grad) in handed))
            continue
        sender, message_id, index, count = received
        slots = outgoing.setdefault((sender, message_id), [None] * count)
        slots[index] = grad if slots[index] is None else slots[index] + grad
    if own:
        if defer:
            context.defer(own)
        else:
            for leaf, grad, shared in own:
                context.accumulate(leaf, grad, shared)
    return outgoing


def _handed_twice(routed: list[tuple[torch.Tensor, Any]]) -> set[int] | tuple[()]:
    """The ids of the gradients handed to more than one leaf (usually none: no set made)."""
    ids = [id(grad) for _, grad in routed]
    if len(set(ids)) == len(ids):
        return ()
    return {key for key in ids if ids.count(key) > 1}


async def propagate(
    agent: DistAutograd,
    table: ContextTable,
    context: AutogradContext,
    roots: Sequence[torch.Tensor],
    grad_outputs: Sequence[Any],
) -> None:
    """Run the local pass as the root of a backward pass, on the loop, then hand its
    gradients to the workers that sent the tensors; returns once the whole pass is over."""
    pass_id = table.credits.begin()
    try:
        outgoing = await pass_anywhere(agent, table, context, roots, grad_outputs)
        root = Hop(agent, table, context, PassCredit(agent.rank, pass_id, FULL))
        await first_of(table.credits.over(pass_id), root.onward(outgoing))
    finally:
        table.credits.end(pass_id)


# What a hop's reply carries: the credit it hands back (an int; only to the root, when the
# root called it), or, where the only gradients its pass gave go back to its caller, those
# gradients with the credit they carry, ``(batches, amount)``: the caller carries on with
# them as with a hop of its own (one message back instead of a hop and its reply).
Batches = list[tuple[int, list[Any]]]
HopReply = int | tuple[Batches, int]
# A hop's credit as it travels: a plain tuple, ``PassCredit``'s fields. Pickling the named
# tuple itself costs a class lookup on both sides of every hop.
WireCredit = tuple[int, int, int]


@inline
@async_execution
def grads_arrived(
    context_id: int, batches: Batches, credit: WireCredit | None = None, caller: int = -1
) -> Future[HopReply]:
    """Runs on the worker that sent the tensors of each ``(message id, grads)`` batch: the
    backward goes on here, in one local pass for all of them (see ``Hop.take``).

    On the loop, as the request arrives (no task before the pass). ``credit``: this hop's
    share of the pass's credit (``asyncrpc.autograd.credit``), split among the hops sent on,
    or handed back to the root when none are; ``caller``: the rank that sent this hop.
    Returns the future of the reply (``HopReply``).
    """
    agent, table = context_table()
    context = table.get(context_id)
    table.count_hop()
    share = None if credit is None else PassCredit(*credit)
    return Hop(agent, table, context, share, caller).take(batches)


def grads_here(
    context_id: int, batches: Batches, credit: WireCredit | None = None, caller: int = -1
) -> HopReply:
    """``grads_arrived`` for a hop that came on a lane (``root_onward``): run on the
    thread that serves the lane, which writes the reply itself, and blocks it until the
    reply is ready (the hops sent on have replied). A plain function: where the request
    came the loop's way instead, it runs on a pool thread, where blocking is allowed too.
    """
    agent, table = context_table()
    context = table.get(context_id)
    table.count_hop()
    share = None if credit is None else PassCredit(*credit)
    # This worker's own gradients are added after the reply is written (hop_replied):
    # the caller waits only for those the reply carries, or for none (a reply first).
    reply = Hop(agent, table, context, share, caller).run_here(batches, defer=True)
    return reply.wait() if isinstance(reply, Future) else reply


def hop_replied(
    context_id: int, batches: Batches, credit: WireCredit | None = None, caller: int = -1
) -> None:
    """Runs on the lane's thread once ``grads_here``'s reply is written (or failed):
    run the pass of a hop that replied first, and add the gradients of this worker's own
    tensors it held back. A late pass's error is the context's readers' (``run_late``):
    it is not raised here."""
    _, table = context_table()
    context = table.find(context_id)
    if context is not None:
        with contextlib.suppress(Exception):  # logged, and raised to the context's readers
            context.settle()


# A hop on a lane travels in its own format (hopwire.py), not pickled.
HOP_CALL: Final = CodedCall(
    "asyncrpc.autograd.hop",
    grads_here,
    dump_hop,
    load_hop,
    dump_hop_reply,
    load_hop_reply,
    hop_replied,
)


def root_onward(root: Hop, outgoing: Outgoing) -> Future[int] | int:
    """``onward`` for the root's own part, from the thread in ``backward()``: a single hop
    goes on this thread's lane to its worker where it has one, and what the reply brings
    back runs right here, and so on, as long as each pass here sends one hop; the future
    of the credit still to hand back (0 when there is none), done when what this thread
    started is over, or that credit itself where it is over already (no future: the usual
    end of a pass whose hops went on the lanes).

    On a lane this thread writes the hop and reads its reply itself: no hand-off to the
    loop and back on this side, and none on the callee, whose lane thread runs the hop.
    A chain of layers on several workers (this worker -> B -> this worker -> A -> this
    worker) goes hop by hop this way. Meanwhile hops of the pass that reach this worker
    run on the loop or the pool (the thread serves none while it is blocked in a lane).

    Raises:
        The hop's error, as its worker raised it (the pass failed).
    """
    hop = root
    while True:  # bounded by the pass: each round is one of its hops, on a lane
        hops = by_sender(outgoing)
        credit = hop.credit
        if len(hops) != 1 or credit is None:
            at_once = hop.at_once(hops)
            return hop.send_on(hops) if at_once is None else at_once  # type: ignore[return-value]
        reply = _lane_hop(hop, credit, hops)
        if reply is NOT_ON_LANE:
            return hop.send_on(hops)  # type: ignore[return-value]  # these embed nothing
        if not isinstance(reply, tuple):
            return hop.hand_on(reply or 0)
        # Gradients back for this worker, with their credit: a hop of its own, here.
        batches, amount = reply
        share = PassCredit(credit.root, credit.pass_id, amount)
        hop = Hop(hop.agent, hop.table, hop.context, share, hop.caller, embeds=False)
        outgoing = hop.pass_here(batches)


def _lane_hop(hop: Hop, credit: PassCredit, hops: dict[int, Batches]) -> Any:
    """Send ``hop``'s one hop on this thread's lane to its worker: its reply, or
    ``NOT_ON_LANE`` (nothing was sent).

    Raises:
        The hop's error, as its worker raised it.
    """
    ((to, batches),) = hops.items()
    agent, table = hop.agent, hop.table
    args = (hop.context.id, batches, tuple(credit), agent.rank)
    threads = table.root_threads
    box = threads.away(credit.pass_id)  # no deadlock on a hop back here meanwhile
    try:
        reply = agent.calls.call_coded_on_lane(to, HOP_CALL, args, UNSET_RPC_TIMEOUT)
    except BaseException:
        table.count_lane_hop()  # a hop that failed counts too
        raise
    finally:
        threads.back(credit.pass_id, box)
    if reply is not NOT_ON_LANE:
        table.count_lane_hop()
    return reply


class Hop:
    """One hop of a pass on the worker it reached: its local pass, the gradients the pass
    sends on, and what its reply carries. Also the root's own part of the pass (no
    caller).

    Args:
        credit: its share of the pass's credit (None: none, it could not be split).
        caller: the rank its reply goes to; -1 for the root's own part.
        embeds: whether gradients that only go back to the caller ride in the reply. A
            hop's own pass does; the work its replies bring back (``follow``) does not:
            its reply may still wait for other hops, which would hold those gradients up.
    """

    __slots__ = ("agent", "caller", "context", "credit", "embeds", "table")

    def __init__(
        self, agent: DistAutograd, table: ContextTable, context: AutogradContext,
        credit: PassCredit | None, caller: int = -1, embeds: bool = True,
    ) -> None:  # fmt: skip
        self.agent, self.table, self.context = agent, table, context
        self.credit, self.caller, self.embeds = credit, caller, embeds

    def take(self, batches: Batches) -> Future[HopReply]:
        """Run the hop's pass and what follows it (on the loop); the future of the reply.

        The pass goes to the thread of this worker waiting in ``backward()`` for this pass,
        if one does (``asyncrpc.autograd.roots``); else it runs on the loop where it is
        small and runs no user code, else on a pool thread.

        Raises:
            The graph's error (a pass on the loop), or the pool's refusal.
        """
        agent, table, context = self.agent, self.table, self.context
        roots, grad_outputs = self._roots(batches)
        replied: Future[HopReply] = Future()
        credit = self.credit
        if credit is not None and credit.root == agent.rank:
            work = functools.partial(self.run_on_thread, roots, grad_outputs, replied)
            if table.root_threads.post(credit.pass_id, work):
                return replied
        outgoing = loop_pass(context, roots, grad_outputs, agent.rank)
        if outgoing is None:
            agent.loop.pool.submit(self.run_on_thread, roots, grad_outputs, replied)
            return replied
        table.count_pass_on_loop()
        return self.onward(outgoing)

    def run_here(self, batches: Batches, defer: bool = False) -> Future[HopReply] | HopReply:
        """Run the hop's pass on this thread (not the loop's: user code may block here),
        then ``onward``; the future of the reply, or the reply itself where the pass sent
        no hop on (no future for a thread that would only wait for it).

        ``defer``: the reply is written before the context settles (a hop on a lane).
        This worker's own gradients are added then (see ``local_pass``), and a planned
        pass that sends nothing on runs whole then (``_reply_first``).

        Raises:
            The graph's error, as ``local_pass`` raises it.
        """
        roots, grad_outputs, planned = self._prepared(batches)
        if defer and planned is not None and runs_after_reply(planned, self.context.recvs):
            return self._reply_first(roots, grad_outputs, planned)
        hops = by_sender(self._pass(roots, grad_outputs, planned, defer))
        at_once = self.at_once(hops)
        return self.send_on(hops) if at_once is None else at_once

    def _reply_first(
        self, roots: list[torch.Tensor], grad_outputs: list[Any], planned: Plan
    ) -> int:
        """The reply of a hop whose pass sends nothing on and cannot fail
        (``graph.runs_after_reply``): its credit, at once. The pass is left to the
        context (``AutogradContext.run_late``): the lane's thread runs it once the reply
        is written, and anything that reads this context's gradients waits for it. The
        caller's ``backward()`` (a layer's owner is often the last hop of a pass)
        returns a local pass sooner."""
        self.table.count_planned()
        self.table.count_replied_first()
        context, rank = self.context, self.agent.rank

        def late() -> None:
            local_pass(context, roots, grad_outputs, rank, False, planned)

        context.run_late(late)
        return self._credit_back()

    def pass_here(self, batches: Batches, defer: bool = False) -> Outgoing:
        """The hop's local pass, on this thread; the gradients it sends on.

        Raises:
            The graph's error, as ``local_pass`` raises it.
        """
        return self._pass(*self._prepared(batches), defer)

    def _prepared(self, batches: Batches) -> tuple[list[torch.Tensor], list[Any], Plan | None]:
        """The roots of the hop's pass, their gradients, and the plan made ahead for them
        where it holds: the usual hop brings the gradients of every tensor of one
        message (``AutogradContext.plan_sent``)."""
        roots, grad_outputs = self._roots(batches)
        planned = None
        if len(batches) == 1 and len(roots) == len(batches[0][1]):
            planned = self.context.planned(batches[0][0])
            if planned is not None and not plan_holds(planned, roots):
                planned = None
        return roots, grad_outputs, planned

    def _pass(
        self, roots: list[torch.Tensor], grad_outputs: list[Any], planned: Plan | None,
        defer: bool,
    ) -> Outgoing:  # fmt: skip
        if planned is not None:
            self.table.count_planned()
        return local_pass(self.context, roots, grad_outputs, self.agent.rank, defer, planned)

    def _roots(self, batches: Batches) -> tuple[list[torch.Tensor], list[Any]]:
        """The tensors this worker sent that the batches bring gradients for, and those."""
        roots, grad_outputs = [], []
        for message_id, grads in batches:
            _, tensors = self.context.sent(message_id)
            for tensor, grad in zip(tensors, grads, strict=True):
                if grad is not None:
                    roots.append(tensor)
                    grad_outputs.append(grad)
        return roots, grad_outputs

    def run_on_thread(
        self, roots: list[torch.Tensor], grad_outputs: list[Any], replied: Future[HopReply]
    ) -> None:
        """The pass on a thread (the one waiting in ``backward()``, or a pool thread: user
        code may block there), then ``onward``; ``replied`` gets the outcome. Never raises
        an ``Exception``: the thread goes on with other work."""
        try:
            onward = self.onward(local_pass(self.context, roots, grad_outputs, self.agent.rank))
        except BaseException as exc:  # the caller gets it in the reply
            try_set_exception(replied, exc)
            if not isinstance(exc, Exception):
                raise
            return
        add_hook(onward, functools.partial(copy_outcome, replied))

    def onward(self, outgoing: Outgoing) -> Future[HopReply]:
        """Send the pass's gradients on (any thread): one hop per worker, or, where they
        all go back to the caller, in the reply; the future of the reply, done once the
        hops sent on have replied and what they brought back has run (failed with the
        first error)."""
        hops = by_sender(outgoing)
        at_once = self.at_once(hops)
        if at_once is None:
            return self.send_on(hops)
        replied: Future[HopReply] = Future()
        replied.set_result(at_once)
        return replied

    def at_once(self, hops: dict[int, Batches]) -> HopReply | None:
        """The reply of a pass that sends no hop on: the credit handed back, or, where its
        gradients all go back to the caller, those (and this hop's credit); None where
        hops go on."""
        if not hops:
            return self._credit_back()
        credit = self.credit
        if credit is not None and self.embeds and len(hops) == 1 and self.caller in hops:
            return hops[self.caller], credit.amount
        return None

    def send_on(self, hops: dict[int, Batches]) -> Future[HopReply]:
        """``onward`` where hops go on: the future of the reply."""
        credit = self.credit
        replied: Future[HopReply] = Future()
        shares = None if credit is None else split(credit, len(hops))
        # Its credit went on with the hops, unless it had none or too little to split.
        keep = credit is not None and shares is None
        sent = self._send(hops, shares)

        def finish(sent: Future[int]) -> None:
            error = sent.exception()
            if error is not None:
                try_set_exception(replied, error)
                return
            try:
                try_set_result(replied, sent.value() + (self._credit_back() if keep else 0))
            except Exception as exc:  # a credit call that could not start
                try_set_exception(replied, exc)

        add_hook(sent, finish)
        return replied

    def _send(self, hops: dict[int, Batches], shares: list[PassCredit] | None) -> Future[int]:
        """One hop per worker, each with its share of credit (or none); the future of the
        credit their replies and what those brought back hand on in this hop's reply."""
        agent, context_id = self.agent, self.context.id
        shared: list[PassCredit | None] = [*shares] if shares else [None] * len(hops)
        followed = []
        for (to, batches), share in zip(hops.items(), shared, strict=True):
            wire = None if share is None else tuple(share)
            call = agent.calls.call_future(
                to, grads_arrived, (context_id, batches, wire, agent.rank), {},
                UNSET_RPC_TIMEOUT,
            )  # fmt: skip
            followed.append(_then_follow(call, functools.partial(self.follow, share)))
        return _summed(collect_all(followed), self)

    def follow(self, share: PassCredit | None, batches: Batches, amount: int) -> Future[int]:
        """The gradients a reply brought back to this worker: a hop of its own here, with
        the credit they carry, whose reply is this hop's (same caller)."""
        credit = None if share is None else PassCredit(share.root, share.pass_id, amount)
        hop = Hop(self.agent, self.table, self.context, credit, self.caller, embeds=False)
        return hop.take(batches)  # type: ignore[return-value]  # it never embeds

    def hand_on(self, returned: int) -> int:
        """Credit that came back to this hop: kept by the root where this is the root,
        else handed on in this hop's reply."""
        credit = self.credit
        if returned and credit is not None and credit.root == self.agent.rank:
            self.table.credits.hand_back(credit.pass_id, returned)
            return 0
        return returned

    def _credit_back(self) -> int:
        credit = self.credit
        if credit is None:
            return 0
        return _return_credit(self.agent, self.table, credit, self.caller)


def _then_follow(
    call: Future[HopReply], follow: Callable[[Batches, int], Future[int]]
) -> Future[int]:
    """The credit ``call``'s reply hands back, or, where it brought gradients back, the
    future of what ``follow`` does with them."""
    out: Future[int] = Future()

    def replied(call: Future[HopReply]) -> None:
        error = call.exception()
        if error is not None:
            try_set_exception(out, error)  # with its original type
            return
        reply = call.value()
        if not isinstance(reply, tuple):
            try_set_result(out, reply or 0)
            return
        try:
            followed = follow(reply[0], reply[1])
        except Exception as exc:  # the graph's error in a pass on the loop
            try_set_exception(out, exc)
            return
        add_hook(followed, functools.partial(copy_outcome, out))

    add_hook(call, replied)
    return out


def _summed(done: Future[list[Future[int]]], hop: Hop) -> Future[int]:
    """The sum of the credit of every future of ``done`` (after ``hop.hand_on``), or the
    first error among them in list order."""
    out: Future[int] = Future()

    def add(done: Future[list[Future[int]]]) -> None:
        # Read, not raised: an error raised here, inside the hooks of whatever completed
        # the last hop, would keep in its traceback every frame of that stack (and their
        # locals: a failed call, its arguments) for as long as ``out`` holds it.
        futures = done.value()
        for future in futures:
            error = future.exception()
            if error is not None:  # a hop's error, with its original type
                try_set_exception(out, error)
                return
        try_set_result(out, hop.hand_on(sum(future.value() for future in futures)))

    add_hook(done, add)
    return out


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


def by_sender(outgoing: Outgoing) -> dict[int, Batches]:
    """The gradients of a local pass grouped by the worker they go to: one hop each, however
    many messages of this context came from it (a model-parallel step that calls one worker
    for each micro-batch sends it one hop, not one per call)."""
    hops: dict[int, Batches] = {}
    for (sender, message_id), grads in outgoing.items():
        hops.setdefault(sender, []).append((message_id, grads))
    return hops
