"""Distributed autograd contexts of one worker: what was sent and received with grad
(layer L3).

A context records, per message of the forward pass, the tensors requiring grad this worker
sent (``sends``: the backward continues from them when the receiver returns their
gradients) and those it received (``recvs``: leaves here whose gradients go back to the
sender), keyed by a message id unique per sender. Gradients of this worker's own leaves
accumulate per context (never into ``.grad``). The id of the context a call runs in is a
``ContextVar``: a ``with``/``async with`` block, or the callee's wrapper, sets it.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from asyncrpc.autograd.credit import Credits
from asyncrpc.autograd.graph import LocalGraph, Plan, plan
from asyncrpc.autograd.roots import RootThreads
from asyncrpc.errors import AutogradContextError

__all__ = ["AutogradContext", "ContextTable", "current_context_id"]

# Context ids and message ids carry the worker's rank in their top bits (torch's rule),
# so they are unique in the group without coordination.
_RANK_SHIFT = 48

_log = logging.getLogger(__name__)

current_context_id: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "asyncrpc_autograd_context", default=None
)


class AutogradContext:
    """One context on one worker. Its methods may run on any thread (one lock)."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self._lock = threading.Lock()
        self._messages = itertools.count(1)
        self.sends: dict[int, tuple[int, list[Any]]] = {}  # message id -> (dest, tensors)
        # id(received tensor) -> (sender rank, message id, index, count); the tensors
        # themselves are kept alive in _received so those ids stay theirs.
        self.recvs: dict[int, tuple[int, int, int, int]] = {}
        self._received: list[Any] = []
        self.grads: dict[Any, Any] = {}  # tensor -> accumulated gradient
        # Gradients of this worker's own tensors a hop's pass gave, added once its reply
        # is written (``defer``), or by whoever reads or adds gradients first.
        self._deferred: list[tuple[Any, Any, bool]] = []
        # Whole passes of hops that replied first (``run_late``), in the order the hops
        # came; run by one thread at a time, and before anything reads or adds gradients.
        self._late: list[Callable[[], None]] = []
        self._late_unfinished = 0  # held or running: a reader must wait for them
        self._late_lock = threading.RLock()  # a late pass adds its own gradients
        self._late_error: Exception | None = None
        self.peers: set[int] = set()  # workers this context exchanged messages with
        # Roots of backward passes run without retain_graph: their graph counts as freed
        # (torch raises on a second pass through it). Held, so their ids stay theirs.
        self.released_roots: dict[int, Any] = {}
        self.graph = LocalGraph()  # runs this worker's passes of the context
        self.plans: dict[int, Plan] = {}  # message id -> its pass, planned ahead (plan_sent)

    def next_message_id(self, rank: int) -> int:
        return (rank << _RANK_SHIFT) | next(self._messages)

    def record_send(self, message_id: int, dest: int, tensors: list[Any]) -> None:
        with self._lock:
            self.peers.add(dest)
            if tensors:
                self.sends[message_id] = (dest, list(tensors))

    def record_recv(self, sender: int, message_id: int, tensors: list[Any]) -> None:
        with self._lock:
            self.peers.add(sender)
            count = len(tensors)
            for index, tensor in enumerate(tensors):
                self.recvs[id(tensor)] = (sender, message_id, index, count)
                self._received.append(tensor)

    def sent(self, message_id: int) -> tuple[int, list[Any]]:
        """The destination and tensors of message ``message_id`` this worker sent.

        Raises:
            AutogradContextError: this worker sent no such message with grad.
        """
        with self._lock:
            found = self.sends.get(message_id)
        if found is None:
            raise AutogradContextError(
                f"autograd context {self.id} has no message {message_id} sent with grad"
            )
        return found

    def plan_sent(self, message_id: int) -> None:
        """Plan the pass the gradients of message ``message_id``'s tensors will start
        (``graph.plan``), ahead of it: for a worker with time to spare (a lane's thread
        that has just written the reply carrying them)."""
        with self._lock:
            found = self.sends.get(message_id)
        planned = None if found is None else plan(found[1])
        if planned is not None:
            with self._lock:
                self.plans[message_id] = planned

    def planned(self, message_id: int) -> Plan | None:
        """The plan ``plan_sent`` made for message ``message_id`` (None: none)."""
        with self._lock:
            return self.plans.get(message_id)

    def accumulate(self, tensor: Any, grad: Any, shared: bool = False) -> None:
        """Add ``grad`` to the gradient of ``tensor`` in this context.

        The first gradient is kept as it is, without a copy (torch's rule), unless it is
        ``shared`` (handed to another tensor too) or its layout differs from the tensor's
        (an expanded or strided gradient): then a copy in the tensor's layout is kept.
        Later ones are added out of place, so a kept gradient is never written to.

        Raises:
            Exception: a pass run late failed (``run_late``).
        """
        self._run_late()
        with self._lock:
            if self._deferred:
                self._add_deferred()
            self._add(tensor, grad, shared)

    def defer(self, grads: list[tuple[Any, Any, bool]]) -> None:
        """``accumulate`` each ``(tensor, grad, shared)`` later: when ``settle`` runs, or
        before anything reads or adds gradients of this context, whichever comes first (so
        the sums, and the order of their terms, are those ``accumulate`` would give).

        For a hop's pass on a lane: its caller waits only for the gradients it sends back,
        so this worker's own are added once the reply is written.
        """
        with self._lock:
            self._deferred.extend(grads)

    def run_late(self, run: Callable[[], None]) -> None:
        """Run ``run``, the whole pass of a hop that has replied already, when ``settle``
        runs or before anything reads or adds gradients of this context, whichever comes
        first (passes in the order they came, each before the gradients ``defer`` held
        back by later hops): whoever reads waits for it.

        For a hop whose pass sends nothing on (``graph.runs_after_reply``): its caller
        waits for nothing the pass gives, so it may have its reply first. Such a pass
        can fail only in a hook on one of its inner tensors: then the error is raised to
        every reader of this context's gradients here (the optimizer's step, say), not by
        the caller's ``backward()``, which has returned.
        """
        with self._lock:
            self._late.append(run)
            self._late_unfinished += 1

    def _run_late(self) -> None:
        """Run the passes ``run_late`` holds, or wait for the one running; raise the
        error of one that failed.

        Raises:
            Exception: a pass run late failed (now or before).
        """
        if not self._late_unfinished and self._late_error is None:
            return  # the usual case, read without a lock: no late pass, none failed
        with self._late_lock:
            while True:  # bounded: each round takes one of the passes
                with self._lock:
                    if not self._late:
                        break
                    run = self._late.pop(0)
                try:
                    run()
                except Exception as exc:  # raised to every reader from now on
                    _log.warning(
                        "autograd context %d: a backward pass that ran after its hop's "
                        "reply failed: %s", self.id, exc,
                    )  # fmt: skip
                    if self._late_error is None:
                        self._late_error = exc
                finally:
                    with self._lock:
                        self._late_unfinished -= 1
        if self._late_error is not None:
            raise self._late_error

    def settle(self) -> None:
        """Run the passes ``run_late`` holds, then add the gradients ``defer`` holds back.

        Raises:
            Exception: a pass run late failed (``run_late``).
        """
        self._run_late()
        with self._lock:
            if self._deferred:
                self._add_deferred()

    def _add_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for tensor, grad, shared in deferred:
            self._add(tensor, grad, shared)

    def _add(self, tensor: Any, grad: Any, shared: bool) -> None:
        held = self.grads.get(tensor)
        if held is not None:
            self.grads[tensor] = held + grad
        elif shared or not _keeps_layout(tensor, grad):
            self.grads[tensor] = _copy_in_layout(tensor, grad)
        else:
            self.grads[tensor] = grad

    def received(self) -> dict[int, Any]:
        """The tensors received with grad in this context, by id."""
        with self._lock:
            return {id(tensor): tensor for tensor in self._received}

    def gradients(self) -> dict[Any, Any]:
        """Every gradient of this worker's own tensors: those accumulated here, and those
        held by the torch context of passes that ran on torch's engine.

        Raises:
            Exception: a pass run late failed (``run_late``).
        """
        self._run_late()
        on_torch_engine = self.graph.gradients()
        with self._lock:
            if self._deferred:
                self._add_deferred()
            grads = dict(self.grads)
        for tensor, grad in on_torch_engine.items():
            held = grads.get(tensor)
            grads[tensor] = grad if held is None else held + grad
        return grads

    def close(self) -> None:
        """Free what the context holds beyond Python objects (its torch context)."""
        self.graph.close()


def _keeps_layout(tensor: Any, grad: Any) -> bool:
    if grad.is_sparse:
        return bool(grad._indices().is_contiguous() and grad._values().is_contiguous())
    if grad.layout != tensor.layout or grad.shape != tensor.shape:
        return False
    if grad.stride() == tensor.stride():
        return True
    return bool(grad.is_contiguous() and tensor.is_contiguous())


def _copy_in_layout(tensor: Any, grad: Any) -> Any:
    if grad.is_sparse or grad.layout != tensor.layout or grad.shape != tensor.shape:
        return grad.clone()
    return torch.empty_like(tensor, dtype=grad.dtype, device=grad.device).copy_(grad)


class ContextTable:
    """The autograd contexts a worker takes part in, by id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[int, AutogradContext] = {}
        self._serial = itertools.count(1)
        self.hops_received = 0  # backward hops run here (see count_hop)
        self.passes_on_loop = 0  # local passes run on the event loop (see count_pass_on_loop)
        self.root_lane_hops = 0  # hops the thread in backward() sent on its lane (count_lane_hop)
        self.passes_planned = 0  # hops whose pass was planned ahead (count_planned)
        self.replied_first = 0  # hops that replied before their pass (count_replied_first)
        self.credits = Credits()  # the backward passes this worker is the root of
        self.root_threads = RootThreads()  # threads waiting in backward() take their hops

    def __len__(self) -> int:
        return len(self._contexts)

    def create(self, rank: int) -> AutogradContext:
        """A new context started on this worker."""
        context = AutogradContext((rank << _RANK_SHIFT) | next(self._serial))
        with self._lock:
            self._contexts[context.id] = context
        return context

    def count_hop(self) -> None:
        """A backward hop reached this worker (for ``get_debug_info``)."""
        with self._lock:
            self.hops_received += 1

    def count_lane_hop(self) -> None:
        """The thread in backward() sent a hop on its lane (for ``get_debug_info``)."""
        with self._lock:
            self.root_lane_hops += 1

    def count_planned(self) -> None:
        """A hop's pass ran as planned ahead (``AutogradContext.plan_sent``)."""
        with self._lock:
            self.passes_planned += 1

    def count_replied_first(self) -> None:
        """A hop replied before its pass ran (``Hop._reply_first``)."""
        with self._lock:
            self.replied_first += 1

    def count_pass_on_loop(self) -> None:
        """A local pass ran on the loop, no pool round trip (for ``get_debug_info``)."""
        with self._lock:
            self.passes_on_loop += 1

    def joined(self, context_id: int) -> AutogradContext:
        """The context ``context_id`` as this worker takes part in it (made on first sight)."""
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                context = self._contexts[context_id] = AutogradContext(context_id)
            return context

    def get(self, context_id: int) -> AutogradContext:
        """Raises: AutogradContextError: this worker has no such context."""
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise AutogradContextError(  # torch's words first, for code that matches them
                f"Could not find autograd context with id: {context_id} (no such context on "
                "this worker: released, or never seen)"
            )
        return context

    def find(self, context_id: int) -> AutogradContext | None:
        """The context ``context_id``, or None where this worker has none (released)."""
        with self._lock:
            return self._contexts.get(context_id)

    def current(self) -> AutogradContext | None:
        context_id = current_context_id.get()
        if context_id is None:
            return None
        with self._lock:
            return self._contexts.get(context_id)

    def pop(self, context_id: int) -> AutogradContext | None:
        with self._lock:
            context = self._contexts.pop(context_id, None)
        if context is not None:
            context.close()
        return context

    def clear(self) -> None:
        with self._lock:
            contexts = list(self._contexts.values())
            self._contexts.clear()
        for context in contexts:
            context.close()
