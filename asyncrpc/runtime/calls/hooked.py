"""The calls as the pipeline's hooks see them: one leaving this worker, one it serves,
and the tensor policy of each message (layer L2.4; see ``pipeline.py`` for the stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy
from asyncrpc.runtime.ports import CallKind

if TYPE_CHECKING:
    import torch

__all__ = [
    "CallTensors",
    "IncomingCall",
    "OutgoingCall",
    "Wrapper",
    "is_stream_source",
    "stream_source",
]

# Takes the function to run and returns the function to run instead (same calling
# convention: a coroutine function's wrapper returns an awaitable).
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

_SOURCE_MARK = "_asyncrpc_stream_source"
_F = TypeVar("_F", bound=Callable[..., Any])


def stream_source(fn: _F) -> _F:
    """Mark ``fn`` as the function a peer calls to read a stream argument this worker
    sent: the stream's items are this worker's own (``IncomingCall.own_items``)."""
    setattr(fn, _SOURCE_MARK, True)
    return fn


def is_stream_source(fn: Any) -> bool:
    """Whether ``fn`` is marked ``stream_source``."""
    return bool(getattr(fn, _SOURCE_MARK, False))


class CallTensors(TensorPolicy):
    """The tensor policy of one message through the pipeline, as its hooks configured it.

    It notes every tensor (``seen``: each one pickled, or rebuilt), and while ``grads`` is
    a list, lists every tensor requiring grad the message carries, in the order of its
    first appearance in the pickle, which both sides share (a segment or a small tensor
    inside the pickle alike). A tensor not in CPU memory goes through ``devices`` (the
    device-map hook's policy; by default refused).
    """

    __slots__ = ("devices", "grads", "seen")

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] | None = None  # None: not tracked
        self.devices: TensorPolicy = DEFAULT

    def track_grads(self) -> None:
        if self.grads is None:
            self.grads = []

    def met(self, tensor: torch.Tensor) -> bool:
        self.seen.append(tensor)
        return False  # small ones, requiring grad or not, ride inside the pickle

    def exported(self, tensor: torch.Tensor) -> None:
        if self.grads is not None and tensor.requires_grad:
            self.grads.append(tensor)

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self.devices.to_host(tensor)

    def to_device(self, segment: torch.Tensor, device: str) -> torch.Tensor:
        return self.devices.to_device(segment, device)

    def imported(self, tensor: torch.Tensor) -> None:
        self.seen.append(tensor)
        if self.grads is not None and tensor.requires_grad:
            self.grads.append(tensor)


class _Call:
    """What both sides' calls share: the tensor policies of the message and its reply."""

    __slots__ = ("policy", "reply_policy", "state")

    def __init__(self) -> None:
        self.policy = CallTensors()
        self.reply_policy = CallTensors()
        # Per-hook state between stages, keyed by the hook (or an object it owns).
        self.state: dict[object, Any] = {}

    def track_grads(self) -> None:
        """Send and list tensors requiring grad, in the request and in its reply."""
        self.policy.track_grads()
        self.reply_policy.track_grads()

    @property
    def grads(self) -> list[torch.Tensor]:
        """The request's tensors requiring grad, in segment order (empty: not tracked)."""
        return self.policy.grads or []

    @property
    def reply_grads(self) -> list[torch.Tensor]:
        """The reply's, once it is pickled (caller: once it is unpickled)."""
        return self.reply_policy.grads or []


class OutgoingCall(_Call):
    """One call leaving this worker, as the hooks see it."""

    __slots__ = (
        "args", "call_id", "callee", "callee_rank", "caller", "fn", "headers", "kind",
        "kwargs", "nbytes", "on_value", "reply_nbytes", "result", "target",
    )  # fmt: skip

    def __init__(
        self, kind: CallKind, caller: str, callee: str, callee_rank: int, fn: Any, target: str,
        args: Sequence[Any], kwargs: dict[str, Any],
    ) -> None:  # fmt: skip
        super().__init__()
        self.kind = kind
        self.caller = caller
        self.callee = callee
        self.callee_rank = callee_rank
        self.fn = fn
        self.target = target  # what the call runs, for names: "module.qualname"
        self.args = args
        self.kwargs = kwargs
        self.call_id = 0
        self.headers: dict[str, Any] = {}
        self.result: Any = None  # the reply's value, once it came
        self.nbytes = 0  # the request frame's size, once it is framed (after ``outgoing``)
        # The reply (or error reply) frame's size, once it came (before ``completed``); 0
        # without one (timeout, lost peer, a remote() or a stream).
        self.reply_nbytes = 0
        # Set by a hook in ``completed``: called on each thread that reads the value, just
        # before it gets it (CUDA: that thread's streams wait for the reply's copies).
        self.on_value: Callable[[], None] | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the payload carries, each time it was met."""
        return self.policy.seen


class IncomingCall(_Call):
    """One request being served by this worker, as the hooks see it."""

    __slots__ = (
        "args", "call_id", "callee", "caller", "caller_rank", "coroutine", "fn", "headers",
        "kwargs", "nbytes", "own_items", "remote", "reply_headers", "reply_nbytes", "target",
        "wrappers",
    )  # fmt: skip

    def __init__(
        self, caller: str, caller_rank: int, callee: str, call_id: int, target: str,
        remote: bool, headers: dict[str, Any], nbytes: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.caller = caller
        self.caller_rank = caller_rank
        self.callee = callee
        self.call_id = call_id
        self.target = target
        self.remote = remote  # a remote() request: the value stays here
        # A stream that reads a stream argument this worker sent: its items are this
        # worker's own, sent as the arguments of the request that carried it were.
        self.own_items = False
        self.headers = headers
        self.nbytes = nbytes  # the request frame's size on the wire (0: not known)
        # The reply's size, known before ``replying``: its payload and tensor segments, and
        # the prelude. Its header is not counted: the hooks' ``replying`` stage is still
        # adding to it. 0: no reply is sent (a remote() without fields, a stream).
        self.reply_nbytes = 0
        self.coroutine = False  # the function is an `async def` (wrappers must keep that)
        self.fn: Any = None
        self.args: Sequence[Any] = ()
        self.kwargs: dict[str, Any] = {}
        self.reply_headers: dict[str, Any] = {}
        self.wrappers: list[Wrapper] = []

    def wrap(self, wrapper: Wrapper) -> None:
        """Run the function through ``wrapper``; the first hook's wrapper is outermost."""
        self.wrappers.append(wrapper)

    def wrapped(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        for wrapper in reversed(self.wrappers):
            fn = wrapper(fn)
        return fn
