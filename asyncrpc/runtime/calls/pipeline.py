"""The call pipeline: one ordered list of hooks every call passes through, on both sides
(layer L2.4).

Cross-cutting features (profiling, distributed autograd, device maps and CUDA streams) are
hooks, in the spirit of gRPC's interceptors and of torch's wrapping of every message: the
outbox, the dispatcher and the lanes call the pipeline at fixed points and know nothing of
what the hooks do (even a stream's items get their tensor policy from the hooks). A hook
is called only for the stages its class overrides.

On the caller, for each outgoing call (``rpc_sync``, ``rpc_async``, ``await call``,
``remote``, RRef proxies and ``to_here``):
  1. ``prepare(call)`` on the calling thread, before the payload is pickled: the hook
     configures the call's tensor policies (``call.policy`` for the request,
     ``call.reply_policy`` for its reply; e.g. ``call.track_grads()``, a device map);
  2. ``outgoing(call)`` on the calling thread, after the payload is pickled: the hook sees
     the function, arguments, every tensor pickled (``call.tensors``) and those that
     require grad (``call.grads``, in segment order, when tracked), and may add header
     fields (``call.headers[key] = ...``, msgpack-able values under a key the hook owns);
  3. ``ready(call)`` on the agent's loop, before the frame is written: the hook returns
     an awaitable the frame must wait for (GPU work still filling its bytes), or None.
     Frames to one peer keep their order: those behind a held frame wait for it too;
  4. ``completed(call, headers, error)`` on the agent's loop when the call ends (reply,
     remote error, timeout, cancellation or lost peer), with the reply's header fields, and
     for a reply its value (``call.result``) and tensors requiring grad (``call.reply_grads``).
On the callee, for each request that carries header fields (or every request while a hook
``serves_all()``):
  5. ``receiving(call)`` on the loop, before the payload is unpickled: the hook sees the
     headers and configures the tensor policies of the request and of its reply;
  6. ``incoming(call)`` on the loop, after the payload is unpickled: the hook sees the
     function, arguments and received tensors requiring grad (``call.grads``), and may
     wrap the execution (``call.wrap(...)``);
  7. ``replying(call, ok, value)`` on the thread that builds the reply, after its payload
     is pickled (``call.reply_grads``) and before it is framed: the hook sees the outcome
     and may add reply header fields;
  8. ``reply_ready(call)`` on the loop, before the reply is written, like ``ready``;
  9. ``replied(call)`` on the thread that ran the request, a lane's, once its reply is
     written: work the caller does not wait for (requests served on the loop's path
     do not call it);
 10. ``stream_items(call, policy)`` on the loop, for a streaming call, before its function
     starts: the tensor policy of its items, given the policy the hooks before it chose
     (``call.own_items``: the stream is a stream argument this worker sent, its items
     this worker's own, as a request's arguments are); then ``items_ready(call)``: what
     to call after each item is pickled, on that thread, for what the item's frame waits
     for before it is written (GPU copies of its tensors; None: nothing) and the bytes it
     holds outside its frame (tensors by handle), or None when its items never wait.
     Items leave in order: those behind a held item wait for it;
 11. ``item_sent(call, grads)`` on the thread that pickles each item of a streaming call
     (the loop, or the pool thread advancing a plain generator), after it is pickled with
     that policy: ``grads`` are its tensors requiring grad when the policy tracks them
     (``TrackGrads``); the hook may return header fields for the item's frame.
On the caller again, for a stream it consumes:
 12. ``items_in(peer)`` on the loop, as a stream from ``peer`` opens (every hook that
     overrides it, active or not: receiving needs no configuration): the policy its
     items are unpickled with; where it has a ``take()``, each item's reader calls what
     ``take`` returned after unpickling it, on its own thread, before it gets the item.
 13. ``item_received(call, headers, grads)`` on the loop, for each item whose frame carries
     header fields, after it is unpickled (its tensors requiring grad tracked): the hook
     sees the fields and ``grads``.
On both ends of every stream, for what a hook keeps per peer rather than per call (CUDA
IPC blocks, given back by the frames that flow the other way):
 14. ``stream_links(peer)`` on the loop, as a stream with ``peer`` opens (either end): a
     ``StreamLinks`` whose ``fields()`` go on each stream frame to ``peer`` (items, credit,
     close, end), or None (nothing, the common case: no cost per frame);
 15. ``stream_received(peer, headers)`` on the loop, for each stream frame from ``peer``
     that carries header fields, before anything else reads them (whether or not its
     stream is still open here): the hook takes its own fields out of ``headers``.
Tracked requiring-grad tensors always travel as segments, so both sides list them in the
same order (see ``TensorPolicy.met``).

An empty or idle pipeline costs one truth test per call: no hook objects are made, and
no header field goes on the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from asyncrpc.functions import is_coroutine_function
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.runtime.calls.hooked import (
    CallTensors,
    IncomingCall,
    OutgoingCall,
    Wrapper,
    is_stream_source,
    stream_source,
)
from asyncrpc.runtime.calls.items import ItemReady, ItemsIn, StreamLinks
from asyncrpc.runtime.ports import CallKind

if TYPE_CHECKING:
    import torch

__all__ = [
    "STAGES",
    "CallHook",
    "CallKind",
    "CallTensors",
    "IncomingCall",
    "ItemReady",
    "ItemsIn",
    "OutgoingCall",
    "Pipeline",
    "StreamLinks",
    "Wrapper",
    "is_stream_source",
    "stream_source",
]

_log = logging.getLogger(__name__)


# The stages a hook may override, in the order a call meets them.
STAGES = (
    "active", "serves_all", "prepare", "outgoing", "ready", "completed", "receiving",
    "incoming", "replying", "reply_ready", "replied", "stream_items", "items_ready",
    "item_sent", "items_in", "item_received", "stream_links", "stream_received",
)  # fmt: skip


class CallHook:
    """Base of pipeline hooks: override what you need; every method defaults to nothing,
    and the pipeline calls a hook only for the stages its class overrides.

    A hook owns its header fields (one short key) and its state. An exception raised by
    ``prepare``, ``outgoing``, ``receiving`` or ``incoming`` fails the call it runs for,
    with that exception; one raised by ``completed`` or ``replying`` (which run after the
    outcome is settled) is logged and the other hooks still run, so a call always
    completes. An awaitable from ``ready`` or ``reply_ready`` that raises drops the frame:
    the call fails with that exception (a reply: the caller gets it as the error).
    """

    stages: ClassVar[frozenset[str]] = frozenset()  # the stages this class overrides
    # The header keys this hook owns (a request naming none of them is nothing to it,
    # unless it serves all), and whether its stages may run on a lane's thread instead of
    # the loop: all they touch is locked, and ``ready``/``reply_ready`` wait for nothing.
    fields: ClassVar[frozenset[str]] = frozenset()
    lane_safe: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.stages = frozenset(
            name for name in STAGES if getattr(cls, name) is not getattr(CallHook, name)
        )

    def active(self) -> bool:
        """Whether outgoing calls should pass through this hook now (called per call)."""
        return True

    def serves_all(self) -> bool:
        """Whether requests without header fields should pass through the callee stages."""
        return False

    def prepare(self, call: OutgoingCall) -> None:
        """A call is about to be pickled (calling thread): configure its tensor policies."""

    def outgoing(self, call: OutgoingCall) -> None:
        """A call is about to be framed (calling thread)."""

    def ready(self, call: OutgoingCall) -> Awaitable[None] | None:
        """What the call's frame must wait for before it is written (agent's loop)."""
        return None

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        """The call ended (agent's loop): ``headers`` of the reply, or None without one."""

    def receiving(self, call: IncomingCall) -> None:
        """A request is about to be unpickled (agent's loop): configure its policies."""

    def incoming(self, call: IncomingCall) -> None:
        """A request is about to run (agent's loop)."""

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        """The request finished; its reply is pickled and about to be framed (any thread)."""

    def reply_ready(self, call: IncomingCall) -> Awaitable[None] | None:
        """What the reply's frame must wait for before it is written (agent's loop)."""
        return None

    def replied(self, call: IncomingCall) -> None:
        """The reply was written by the thread that ran the request, a lane's: work the
        caller does not wait for may run here, before the lane reads its next request.
        Requests served on the loop's path do not call it."""

    def stream_items(self, call: IncomingCall, policy: TensorPolicy | None) -> TensorPolicy | None:
        """The tensor policy of a streaming call's items, given ``policy``, what the hooks
        before this one chose (None: the defaults); ``items_ready`` may then hold each
        item's frame (agent's loop)."""
        return policy

    def item_sent(self, call: IncomingCall, grads: list[torch.Tensor]) -> dict[str, Any] | None:
        """An item of a streaming call was pickled (the thread that pickles it): ``grads``
        are its tensors requiring grad, if its policy tracks them. Returns header fields
        for the item's frame (None: none)."""
        return None

    def items_ready(self, call: IncomingCall) -> ItemReady | None:
        """What to call after each item of a streaming call is pickled (on that thread):
        it returns what the item's frame waits for, awaited on the loop (None: nothing),
        and the bytes the item holds outside its frame (its byte credit counts them).
        None: its items never wait (agent's loop, once per stream)."""
        return None

    def items_in(self, peer: int) -> ItemsIn | None:
        """The tensor policy of the items of a stream this worker opens from ``peer``
        (agent's loop); None: the defaults."""
        return None

    def item_received(
        self, call: OutgoingCall, headers: dict[str, Any], grads: list[torch.Tensor]
    ) -> None:
        """An item carrying header fields arrived on a stream this worker consumes and was
        unpickled (agent's loop); ``grads`` are its tensors requiring grad."""

    def stream_links(self, peer: int) -> StreamLinks | None:
        """What this hook adds to the frames of a stream with ``peer`` opening here, at
        either end (agent's loop); None: nothing."""
        return None

    def stream_received(self, peer: int, headers: dict[str, Any]) -> None:
        """A stream frame from ``peer`` carried ``headers`` (agent's loop): take this
        hook's own fields out of it."""

    def debug_info(self) -> dict[str, Any]:
        """What this hook adds to ``get_debug_info()``."""
        return {}


class Pipeline:
    """The ordered hooks of one agent, and for each stage those that override it."""

    __slots__ = ("_by_stage", "_hooks")

    def __init__(self, hooks: Sequence[CallHook] = ()) -> None:
        self._hooks: tuple[CallHook, ...] = ()
        self._by_stage: dict[str, tuple[CallHook, ...]] = {}
        self._set(tuple(hooks))

    def __bool__(self) -> bool:
        return bool(self._hooks)

    @property
    def hooks(self) -> tuple[CallHook, ...]:
        return self._hooks

    def add(self, hook: CallHook) -> None:
        """Append ``hook`` (new tuples: readers on other threads see one or the other)."""
        if hook not in self._hooks:
            self._set((*self._hooks, hook))

    def remove(self, hook: CallHook) -> None:
        self._set(tuple(h for h in self._hooks if h is not hook))

    def _set(self, hooks: tuple[CallHook, ...]) -> None:
        by_stage = {name: tuple(h for h in hooks if name in h.stages) for name in STAGES}
        self._by_stage, self._hooks = by_stage, hooks  # the table first: see active_hooks

    def overriding(self, stage: str) -> tuple[CallHook, ...]:
        """The hooks that override ``stage``, in order."""
        return self._by_stage[stage]

    # -- caller side -----------------------------------------------------------------------

    def active_hooks(self) -> tuple[CallHook, ...]:
        """The hooks an outgoing call goes through now (often none)."""
        hooks = self._hooks
        if not hooks:
            return hooks
        if len(hooks) == 1:  # the common case: no new tuple
            hook = hooks[0]
            return hooks if "active" not in hook.stages or hook.active() else ()
        active: tuple[CallHook, ...] = ()
        for hook in hooks:  # a loop, no generator per call
            if "active" not in hook.stages or hook.active():
                active = (*active, hook)
        return active

    @staticmethod
    def prepare(hooks: Sequence[CallHook], call: OutgoingCall) -> None:
        for hook in hooks:
            if "prepare" in hook.stages:
                hook.prepare(call)

    @staticmethod
    def outgoing(hooks: Sequence[CallHook], call: OutgoingCall) -> None:
        for hook in hooks:
            if "outgoing" in hook.stages:
                hook.outgoing(call)

    @staticmethod
    def ready(hooks: Sequence[CallHook], call: OutgoingCall) -> Awaitable[None] | None:
        """What the call's frame waits for: None, or one awaitable for all hooks'."""
        return _all_of([hook.ready(call) for hook in hooks if "ready" in hook.stages])

    @staticmethod
    def completed(
        hooks: Sequence[CallHook],
        call: OutgoingCall,
        headers: dict[str, Any] | None,
        error: BaseException | None,
    ) -> None:
        for hook in hooks:
            if "completed" not in hook.stages:
                continue
            try:
                hook.completed(call, headers, error)
            except Exception:
                _log.exception("call hook %r failed after call %s", hook, call.target)

    # -- callee side -----------------------------------------------------------------------

    def serves(self, headers: dict[str, Any] | None) -> bool:
        """Whether a request with these header fields goes through the hooks."""
        if headers is not None:
            return bool(self._hooks)
        for hook in self._by_stage["serves_all"]:  # noqa: SIM110 (no generator per request)
            if hook.serves_all():
                return True
        return False

    def on_lanes(self, headers: dict[str, Any] | None) -> bool:
        """Whether a request with these header fields may be served on a lane's thread:
        no hook serves every request, and those its fields name are lane-safe."""
        if headers is None:
            return not self.serves(None)
        for hook in self._hooks:
            if hook.serves_all() or (not hook.lane_safe and not hook.fields.isdisjoint(headers)):
                return False
        return True

    def received(
        self, caller: str, caller_rank: int, callee: str, call_id: int, target: str,
        remote: bool, headers: dict[str, Any] | None, nbytes: int = 0,
    ) -> IncomingCall:  # fmt: skip
        """A request as the hooks see it, their ``receiving`` stage run: its tensor
        policies are set before it is unpickled. ``nbytes``: its frame's size."""
        call = IncomingCall(
            caller, caller_rank, callee, call_id, target, remote, headers or {}, nbytes
        )
        self.receiving(call)
        return call

    def serve(self, call: IncomingCall, fn: Any, args: Any, kwargs: Any) -> Any:
        """Run the ``incoming`` stage on the unpickled request; its function, wrapped."""
        call.fn, call.args, call.kwargs = fn, args, kwargs
        call.coroutine = is_coroutine_function(fn)
        self.incoming(call)
        return call.wrapped(fn)

    def reply_fields(
        self, call: IncomingCall, ok: bool, value: Any, nbytes: int = 0
    ) -> dict[str, Any] | None:
        """Run the ``replying`` stage; the reply's header fields (None: none). ``nbytes``:
        the reply's size so far (see ``IncomingCall.reply_nbytes``)."""
        call.reply_nbytes = nbytes
        self.replying(call, ok, value)
        return call.reply_headers or None

    def receiving(self, call: IncomingCall) -> None:
        for hook in self._by_stage["receiving"]:
            hook.receiving(call)

    def incoming(self, call: IncomingCall) -> None:
        for hook in self._by_stage["incoming"]:
            hook.incoming(call)

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        for hook in self._by_stage["replying"]:
            try:
                hook.replying(call, ok, value)
            except Exception:
                _log.exception("call hook %r failed replying to %s", hook, call.target)

    def item_policy(self, call: IncomingCall) -> TensorPolicy | None:
        """The tensor policy of a streaming call's items, as its hooks chose it in turn."""
        policy: TensorPolicy | None = None
        for hook in self._by_stage["stream_items"]:
            policy = hook.stream_items(call, policy)
        return policy

    def item_fields(self, call: IncomingCall, grads: list[torch.Tensor]) -> dict[str, Any] | None:
        """Run the ``item_sent`` stage for one item; its header fields (None: none)."""
        fields: dict[str, Any] | None = None
        for hook in self._by_stage["item_sent"]:
            more = hook.item_sent(call, grads)
            if more:
                fields = more if fields is None else {**fields, **more}
        return fields

    def items_ready(self, call: IncomingCall) -> ItemReady | None:
        """What each item of a streaming call waits for (see ``CallHook.items_ready``): the
        one hook's that gives one, called as is (nothing per item for the others)."""
        ready = [r for r in (h.items_ready(call) for h in self._by_stage["items_ready"]) if r]
        if len(ready) > 1:
            return lambda: _both([each() for each in ready])
        return ready[0] if ready else None

    def items_in(self, peer: int) -> ItemsIn | None:
        """The policy of a consumed stream's items: the first hook's that gives one."""
        for hook in self._by_stage["items_in"]:
            policy = hook.items_in(peer)
            if policy is not None:
                return policy
        return None

    def stream_links(self, peer: int) -> StreamLinks | None:
        """What the hooks add to the frames of a stream with ``peer``: the first hook's
        that gives one (one hook owns the per-peer state today: CUDA IPC)."""
        for hook in self._by_stage["stream_links"]:
            links = hook.stream_links(peer)
            if links is not None:
                return links
        return None

    def stream_received(self, peer: int, headers: dict[str, Any]) -> None:
        """Each hook takes its fields out of a stream frame's ``headers`` from ``peer``."""
        for hook in self._by_stage["stream_received"]:
            hook.stream_received(peer, headers)

    @staticmethod
    def item_received(
        hooks: Sequence[CallHook], call: OutgoingCall, headers: dict[str, Any],
        grads: list[torch.Tensor],
    ) -> None:  # fmt: skip
        for hook in hooks:
            if "item_received" in hook.stages:
                hook.item_received(call, headers, grads)

    def replied(self, call: IncomingCall) -> None:
        for hook in self._by_stage["replied"]:
            try:
                hook.replied(call)
            except Exception:
                _log.exception("call hook %r failed after replying to %s", hook, call.target)

    def reply_ready(self, call: IncomingCall) -> Awaitable[None] | None:
        """What the reply's frame waits for: None, or one awaitable for all hooks'."""
        hooks = self._by_stage["reply_ready"]
        if not hooks:
            return None
        return _all_of([hook.reply_ready(call) for hook in hooks])


def _both(
    readies: list[tuple[Awaitable[None] | None, int]],
) -> tuple[Awaitable[None] | None, int]:
    """Several hooks' readiness of one item: all their waits, and their bytes together."""
    return _all_of([wait for wait, _ in readies]), sum(held for _, held in readies)


def _all_of(waits: list[Awaitable[None] | None]) -> Awaitable[None] | None:
    pending = [w for w in waits if w is not None]
    if not pending:
        return None
    if len(pending) == 1:
        return pending[0]
    return _in_order(pending)


async def _in_order(waits: list[Awaitable[None]]) -> None:
    # One after the other: a hook's wait may rely on the one before it being over.
    for wait in waits:
        await wait
