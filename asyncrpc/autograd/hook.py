"""The distributed autograd hook of the call pipeline (layer L3).

Inside a context, each outgoing call carries ``ag: [context id, message id]`` and records
the tensors requiring grad it sent; the callee joins the context, records those it
received, runs the function inside the context (so its own calls and its reply take part),
and records its reply's tensors requiring grad under a message id of its own, which the
reply's ``ag`` field names; the caller records them as received. Outside any context the
hook adds nothing to a frame; inside one, neither does a call of a builtin op (``torch.add``)
that sends no tensor requiring grad: its result cannot require grad and it makes no calls.
Python functions always carry the field (torch forces grad recording for them too): their
result may come from parameters that live on the callee.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator
from types import BuiltinFunctionType
from typing import Any, NamedTuple

from asyncrpc.autograd.context import AutogradContext, ContextTable, current_context_id
from asyncrpc.autograd.release import Releases
from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy, TrackGrads
from asyncrpc.runtime.calls.pipeline import CallHook, IncomingCall, OutgoingCall

__all__ = ["FIELD", "RELEASED", "AutogradHook"]

FIELD = "ag"  # the header fields this hook owns: the call's context and message ids,
RELEASED = "agr"  # and the ids of contexts the caller left (see asyncrpc.autograd.release)
_SENT = "autograd: reply sent with grad"  # call.state: (context, message id), for replied


class _Sent(NamedTuple):
    """What a call made through the hook carries: its context, the releases riding on it."""

    context: AutogradContext | None
    released: list[int]


class AutogradHook(CallHook):
    """Records the sends and receives of every call made in a distributed autograd context.

    Lane-safe: its stages touch the context table and contexts under their locks, and the
    release batcher under its own, so they may run on a lane's thread (runtime/lanes/).
    """

    fields = frozenset({FIELD, RELEASED})
    lane_safe = True

    def __init__(self, rank: int, contexts: ContextTable, releases: Releases) -> None:
        self._rank = rank  # this worker's rank
        self.contexts = contexts
        self._releases = releases

    def __repr__(self) -> str:
        return "AutogradHook()"

    # -- caller ----------------------------------------------------------------------------

    def active(self) -> bool:
        return current_context_id.get() is not None

    def prepare(self, call: OutgoingCall) -> None:
        # Tensors requiring grad are listed on both sides, in the order they are pickled.
        if self.contexts.current() is not None:
            call.track_grads()

    def outgoing(self, call: OutgoingCall) -> None:
        released = self._riding(call)
        context = self.contexts.current()
        if context is None or (not call.grads and isinstance(call.fn, BuiltinFunctionType)):
            # Released, or a builtin op with no tensor requiring grad (see the docstring).
            if released:
                call.state[self] = _Sent(None, released)
            return
        message_id = context.next_message_id(self._rank)
        context.record_send(message_id, call.callee_rank, call.grads)
        call.headers[FIELD] = [context.id, message_id]
        call.state[self] = _Sent(context, released)

    def _riding(self, call: OutgoingCall) -> list[int]:
        """Releases queued for the callee, taken to ride along on this call."""
        released = self._releases.take_for(call.callee_rank)
        if released:
            call.headers[RELEASED] = released
        return released

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        sent = call.state.pop(self, None)
        if not isinstance(sent, _Sent):
            return
        if sent.released and error is not None:
            self._releases.queue({call.callee_rank: sent.released})  # may not have arrived
        fields = None if headers is None else headers.get(FIELD)
        if sent.context is not None and fields and call.reply_grads:
            sent.context.record_recv(call.callee_rank, int(fields[1]), call.reply_grads)

    # -- callee ----------------------------------------------------------------------------

    def receiving(self, call: IncomingCall) -> None:
        if call.headers.get(FIELD):
            call.track_grads()
        released = call.headers.get(RELEASED)
        if released:  # contexts the caller left, riding along: released here and onward
            self._releases.onward([int(c) for c in released], call.caller_rank)

    def incoming(self, call: IncomingCall) -> None:
        fields = call.headers.get(FIELD)
        if not fields:
            return
        context_id, message_id = int(fields[0]), int(fields[1])
        context = self.contexts.joined(context_id)
        context.record_recv(call.caller_rank, message_id, call.grads)
        call.state[self] = context
        call.wrap(functools.partial(_within, context_id=context_id, coroutine=call.coroutine))

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        context = call.state.pop(self, None)
        if not isinstance(context, AutogradContext):
            return
        message_id = context.next_message_id(self._rank)
        grads = call.reply_grads
        context.record_send(message_id, call.caller_rank, grads)
        call.reply_headers[FIELD] = [context.id, message_id]
        if grads:
            call.state[_SENT] = (context, message_id)

    def replied(self, call: IncomingCall) -> None:
        # The reply carried tensors requiring grad: plan the pass their gradients will
        # start (the walk of their graph) now, while the caller is busy, not in its hop.
        sent = call.state.pop(_SENT, None)
        if sent is not None:
            context, message_id = sent
            context.plan_sent(message_id)

    def stream_items(self, call: IncomingCall, policy: TensorPolicy | None) -> TensorPolicy | None:
        if call.reply_policy.grads is None:
            return policy
        # A stream opened inside a distributed autograd context: each item is a message
        # of its own, its tensors requiring grad listed as a reply's are (item_sent).
        return TrackGrads(policy or DEFAULT)

    def item_sent(self, call: IncomingCall, grads: list[Any]) -> dict[str, Any] | None:
        # Pickling thread (a pool thread for a plain generator): the context is locked.
        context = call.state.get(self)
        if not isinstance(context, AutogradContext) or not grads:
            return None  # an item without grad needs no message: nothing flows back
        message_id = context.next_message_id(self._rank)
        context.record_send(message_id, call.caller_rank, grads)
        return {FIELD: [context.id, message_id]}

    def item_received(self, call: OutgoingCall, headers: dict[str, Any], grads: list[Any]) -> None:
        sent = call.state.get(self)
        fields = headers.get(FIELD)
        if isinstance(sent, _Sent) and sent.context is not None and fields and grads:
            sent.context.record_recv(call.callee_rank, int(fields[1]), grads)

    def debug_info(self) -> dict[str, Any]:
        contexts = self.contexts
        return {
            "num_autograd_contexts": len(contexts),
            "autograd_hops_received": contexts.hops_received,
            "autograd_passes_on_loop": contexts.passes_on_loop,
            "autograd_hops_taken_by_root": contexts.root_threads.hops_taken,
            "autograd_root_hops_on_lane": contexts.root_lane_hops,
            "autograd_passes_planned_ahead": contexts.passes_planned,
            "autograd_hops_replied_first": contexts.replied_first,
            "autograd_passes_over_by_credit": contexts.credits.passes_over_early,
            "autograd_credit_calls": contexts.credits.calls,
            "autograd_releases_carried": self._releases.carried,
        }


def _within(fn: Callable[..., Any], context_id: int, coroutine: bool) -> Callable[..., Any]:
    """``fn`` run inside autograd context ``context_id`` (same calling convention)."""
    if coroutine:

        async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
            # This runs in the request's own task, whose context is a copy: no reset.
            current_context_id.set(context_id)
            return _streamed_within(await fn(*args, **kwargs), context_id)

        return run_coroutine

    def run(*args: Any, **kwargs: Any) -> Any:
        token = current_context_id.set(context_id)
        try:
            result = fn(*args, **kwargs)
        finally:
            current_context_id.reset(token)
        # An @async_execution function's coroutine (inspect's test: asyncio's also takes a
        # plain generator, such as a stream's, for an old-style coroutine).
        if inspect.iscoroutine(result):
            return _awaited_within(result, context_id)
        return _streamed_within(result, context_id)

    return run


def _streamed_within(result: Any, context_id: int) -> Any:
    """A stream's generator, each step of it run inside the context (a generator's body
    runs when it is advanced, long after the call that made it returned): its own calls
    and the stream arguments it reads take part. Anything else as it is."""
    if inspect.isgenerator(result):
        return _steps_within(result, context_id)
    if inspect.isasyncgen(result):
        return _async_steps_within(result, context_id)
    return result


def _steps_within(gen: Generator[Any, Any, Any], context_id: int) -> Iterator[Any]:
    try:
        while True:
            token = current_context_id.set(context_id)
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                current_context_id.reset(token)
            yield item
    finally:
        gen.close()  # closed early (the consumer left): the generator's finally runs


async def _async_steps_within(agen: AsyncGenerator[Any, Any], context_id: int) -> Any:
    # Driven by one task of its own (calls/streams/producer.py): set in it, the context
    # holds for every step and for nothing else.
    current_context_id.set(context_id)
    try:
        async for item in agen:
            yield item
    finally:
        await agen.aclose()


async def _awaited_within(coro: Coroutine[Any, Any, Any], context_id: int) -> Any:
    # Awaited in a task of its own later: the context goes with it.
    current_context_id.set(context_id)
    return await coro
