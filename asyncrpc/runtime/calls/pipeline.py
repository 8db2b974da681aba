"""The call pipeline: one ordered list of hooks every call passes through, on both sides
(layer L2).

Cross-cutting features (profiling, and next distributed autograd, CUDA streams and
authentication context) are hooks, in the spirit of gRPC's interceptors and of torch's
wrapping of every message: the agent and the dispatcher call the pipeline at fixed points
and know nothing of what the hooks do.

On the caller, for each outgoing call (``rpc_sync``, ``rpc_async``, ``await call``,
``remote``, RRef proxies and ``to_here``):
  1. ``outgoing(call)`` on the calling thread, after the payload is pickled: the hook sees
     the function, arguments, every tensor pickled (``call.tensors``) and those that
     require grad (``call.grads``, in segment order), and may add header fields
     (``call.headers[key] = ...``, msgpack-able values under a key the hook owns);
  2. ``completed(call, headers, error)`` on the agent's loop when the call ends (reply,
     remote error, timeout, cancellation or lost peer), with the reply's header fields, and
     for a reply its value (``call.result``) and tensors requiring grad (``call.reply_grads``).
On the callee, for each request that carries header fields (or every request while a hook
``serves_all()``):
  3. ``incoming(call)`` on the loop, after the payload is unpickled: the hook sees the
     headers, function, arguments and received tensors requiring grad (``call.grads``),
     and may wrap the execution (``call.wrap(...)``);
  4. ``replying(call, ok, value)`` on the thread that builds the reply, after its payload
     is pickled (``call.reply_grads``) and before it is framed: the hook sees the outcome
     and may add reply header fields.
Requiring-grad tensors of calls that go through hooks always travel as segments, so both
sides list them in the same order (see ``Serializer.dumps``).

An empty or idle pipeline costs one truth test per call: no hook objects are made, and
no header field goes on the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CallHook", "IncomingCall", "OutgoingCall", "Pipeline", "Wrapper"]

_log = logging.getLogger("asyncrpc.pipeline")

# Takes the function to run and returns the function to run instead (same calling
# convention: a coroutine function's wrapper returns an awaitable).
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class OutgoingCall:
    """One call leaving this worker, as the hooks see it."""

    __slots__ = (
        "args",
        "call_id",
        "callee",
        "callee_rank",
        "caller",
        "fn",
        "grads",
        "headers",
        "kind",
        "kwargs",
        "reply_grads",
        "result",
        "state",
        "target",
        "tensors",
    )

    def __init__(
        self, kind: str, caller: str, callee: str, callee_rank: int, fn: Any, target: str,
        args: Sequence[Any], kwargs: dict[str, Any],
    ) -> None:  # fmt: skip
        self.kind = kind  # torch's exec modes: "sync", "async", "remote"
        self.caller = caller
        self.callee = callee
        self.callee_rank = callee_rank
        self.fn = fn
        self.target = target  # what the call runs, for names: "module.qualname"
        self.args = args
        self.kwargs = kwargs
        self.call_id = 0
        self.tensors: list[Any] = []  # every tensor the payload carries
        self.grads: list[Any] = []  # those requiring grad, once each, in segment order
        self.headers: dict[str, Any] = {}
        self.result: Any = None  # the reply's value, once it came
        self.reply_grads: list[Any] = []  # its tensors requiring grad, in segment order
        # Per-hook state between outgoing() and completed(), keyed by the hook.
        self.state: dict[CallHook, Any] = {}


class IncomingCall:
    """One request being served by this worker, as the hooks see it."""

    __slots__ = (
        "args",
        "call_id",
        "callee",
        "caller",
        "caller_rank",
        "coroutine",
        "fn",
        "grads",
        "headers",
        "kwargs",
        "remote",
        "reply_grads",
        "reply_headers",
        "state",
        "target",
        "wrappers",
    )

    def __init__(
        self, caller: str, caller_rank: int, callee: str, call_id: int, target: str,
        remote: bool, headers: dict[str, Any],
    ) -> None:  # fmt: skip
        self.caller = caller
        self.caller_rank = caller_rank
        self.callee = callee
        self.call_id = call_id
        self.target = target
        self.remote = remote  # a remote() request: the value stays here
        self.headers = headers
        self.coroutine = False  # the function is an `async def` (wrappers must keep that)
        self.grads: list[Any] = []  # received tensors requiring grad, in segment order
        self.reply_grads: list[Any] = []  # the reply's, once it is pickled
        self.fn: Any = None
        self.args: Sequence[Any] = ()
        self.kwargs: dict[str, Any] = {}
        self.reply_headers: dict[str, Any] = {}
        self.wrappers: list[Wrapper] = []
        self.state: dict[CallHook, Any] = {}

    def wrap(self, wrapper: Wrapper) -> None:
        """Run the function through ``wrapper``; the first hook's wrapper is outermost."""
        self.wrappers.append(wrapper)

    def wrapped(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        for wrapper in reversed(self.wrappers):
            fn = wrapper(fn)
        return fn


class CallHook:
    """Base of pipeline hooks: override what you need; every method defaults to nothing.

    A hook owns its header fields (one short key) and its state. An exception raised by
    ``outgoing`` or ``incoming`` fails the call it runs for, with that exception; one raised
    by ``completed`` or ``replying`` (which run after the outcome is settled) is logged
    and the other hooks still run, so a call always completes.
    """

    def active(self) -> bool:
        """Whether outgoing calls should pass through this hook now (called per call)."""
        return True

    def serves_all(self) -> bool:
        """Whether requests without header fields should pass through ``incoming``."""
        return False

    def outgoing(self, call: OutgoingCall) -> None:
        """A call is about to be framed (calling thread)."""

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        """The call ended (agent's loop): ``headers`` of the reply, or None without one."""

    def incoming(self, call: IncomingCall) -> None:
        """A request is about to run (agent's loop)."""

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        """The request finished; its reply is pickled and about to be framed (any thread)."""

    def debug_info(self) -> dict[str, Any]:
        """What this hook adds to ``get_debug_info()``."""
        return {}


class Pipeline:
    """The ordered hooks of one agent."""

    __slots__ = ("_hooks",)

    def __init__(self, hooks: Sequence[CallHook] = ()) -> None:
        self._hooks: tuple[CallHook, ...] = tuple(hooks)

    def __bool__(self) -> bool:
        return bool(self._hooks)

    @property
    def hooks(self) -> tuple[CallHook, ...]:
        return self._hooks

    def add(self, hook: CallHook) -> None:
        """Append ``hook`` (a new tuple: readers on other threads see one or the other)."""
        if hook not in self._hooks:
            self._hooks = (*self._hooks, hook)

    def remove(self, hook: CallHook) -> None:
        self._hooks = tuple(h for h in self._hooks if h is not hook)

    # -- caller side -----------------------------------------------------------------------

    def active_hooks(self) -> tuple[CallHook, ...]:
        """The hooks an outgoing call goes through now (often none)."""
        hooks = self._hooks
        if not hooks:
            return hooks
        if len(hooks) == 1:  # the common case: no generator, no new tuple
            return hooks if hooks[0].active() else ()
        return tuple(h for h in hooks if h.active())

    @staticmethod
    def outgoing(hooks: Sequence[CallHook], call: OutgoingCall) -> None:
        for hook in hooks:
            hook.outgoing(call)

    @staticmethod
    def completed(
        hooks: Sequence[CallHook],
        call: OutgoingCall,
        headers: dict[str, Any] | None,
        error: BaseException | None,
    ) -> None:
        for hook in hooks:
            try:
                hook.completed(call, headers, error)
            except Exception:
                _log.exception("call hook %r failed after call %s", hook, call.target)

    # -- callee side -----------------------------------------------------------------------

    def serves(self, headers: dict[str, Any] | None) -> bool:
        """Whether a request with these header fields goes through the hooks."""
        hooks = self._hooks
        if headers is not None:
            return bool(hooks)
        for hook in hooks:  # noqa: SIM110 (a loop, not any(): no generator per request)
            if hook.serves_all():
                return True
        return False

    def incoming(self, call: IncomingCall) -> None:
        for hook in self._hooks:
            hook.incoming(call)

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        for hook in self._hooks:
            try:
                hook.replying(call, ok, value)
            except Exception:
                _log.exception("call hook %r failed replying to %s", hook, call.target)
