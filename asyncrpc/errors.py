"""The one exception tree of asyncrpc (layer L0: standard library only).

Every error says who broke what: protocol errors are split into ours (local) and the
peer's (remote); a connection we closed is a ``ClosedError``, one the network or the peer
broke is a ``ConnectionLostError``. Timeouts also subclass the builtin ``TimeoutError`` and
connection failures the builtin ``ConnectionError``, so generic handlers keep working.
Where torch.distributed.rpc raises ``RuntimeError``, ours subclass ``RuntimeError`` too,
and their messages carry torch's wording, so code written for torch
(``except RuntimeError``, ``"..." in str(e)``) keeps working unchanged.
Every error pickles, because errors travel between workers.
"""

from __future__ import annotations

from typing import cast

__all__ = [
    "AsyncExecutionError",
    "AsyncRpcError",
    "AuthenticationError",
    "AutogradContextError",
    "BadDestinationError",
    "BlockingCallError",
    "CallbackError",
    "ClosedError",
    "ConnectionLostError",
    "FrameTooLargeError",
    "FunctionNotFoundError",
    "InitArgumentError",
    "InitError",
    "LocalProtocolError",
    "MissingRankError",
    "MixedGroupError",
    "NotInitializedError",
    "OperatorArgumentsError",
    "PeerLostError",
    "PeerUnavailableError",
    "ProtocolError",
    "RRefError",
    "RRefOwnerLostError",
    "RRefTimeoutError",
    "RemoteError",
    "RemoteProtocolError",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "ThreadPoolExhaustedError",
    "UnknownWorkerError",
    "WorkerNameError",
    "as_callback_error",
]


class AsyncRpcError(Exception):
    """Root of every error asyncrpc raises itself.

    Subclasses that carry data keep it in ``args`` so the default pickling rebuilds them.
    """


# -- lifecycle -----------------------------------------------------------------------------


class InitError(AsyncRpcError, RuntimeError):
    """``init_rpc`` failed: bad options, duplicate name or rank, rendezvous trouble."""


class InitArgumentError(InitError, TypeError):
    """An ``init_rpc`` argument has the wrong type (a backend or options object asyncrpc
    cannot use)."""


class WorkerNameError(InitError, ValueError):
    """A worker name is empty, too long, or has characters outside ``[A-Za-z0-9_:-]``."""


class MissingRankError(InitError, ValueError):
    """No rank was given and the init method has none to offer (``file://`` and ``tcp://``
    never do; ``env://`` reads ``RANK``). A ``ValueError``, as torch's rendezvous raises."""


class MixedGroupError(InitError):
    """A worker joined with ``world_size`` given (static) where the group's members joined
    without one (dynamic), or the other way round."""


class NotInitializedError(AsyncRpcError, RuntimeError):
    """An RPC API was used before ``init_rpc`` or after ``shutdown``."""


class ShutdownError(AsyncRpcError, RuntimeError):
    """A graceful shutdown could not complete (a peer died or the timeout ran out)."""


class BlockingCallError(AsyncRpcError, RuntimeError):
    """A blocking API (``rpc_sync``, ``Future.wait``...) was called on the agent's loop thread.

    Blocking there would deadlock: the loop that must deliver the reply is the one waiting.
    """


# -- addressing and arguments --------------------------------------------------------------


class ThreadPoolExhaustedError(AsyncRpcError, RuntimeError):
    """Every thread of a worker's pool, up to its hard cap (``max_worker_threads``), is
    blocked waiting on an RPC reply: a queued synchronous function cannot run (nested
    blocking calls deeper than the cap)."""

    def __init__(self, worker: str, cap: int) -> None:
        super().__init__(worker, cap)
        self.worker = worker
        self.cap = cap

    def __str__(self) -> str:
        return (
            f"worker {self.worker!r}: all {self.cap} pool threads are blocked waiting on RPC "
            "replies (nested blocking calls deeper than max_worker_threads); use async "
            "functions or raise max_worker_threads"
        )


class UnknownWorkerError(AsyncRpcError, LookupError, RuntimeError):
    """The destination names no worker of this group."""

    def __init__(self, worker: object, known: tuple[str, ...] = ()) -> None:
        super().__init__(worker, known)
        self.worker = worker
        self.known = known

    def __str__(self) -> str:
        known = ", ".join(self.known) if self.known else "none"
        return (
            f"unknown worker {self.worker!r}: could not find destination in this group "
            f"(known workers: {known})"
        )


class BadDestinationError(UnknownWorkerError, ValueError):
    """The destination is not a worker name, a rank or a ``WorkerInfo`` (a float, say)."""

    def __str__(self) -> str:
        return (
            f"bad destination {self.worker!r}: pass a worker name, a rank or a WorkerInfo "
            "(not a valid worker id)"
        )


class SerializationError(AsyncRpcError, TypeError, RuntimeError):
    """A value could not be pickled or unpickled.

    Raised at the caller, before anything is sent, for unpicklable arguments; sent back by
    the callee for results it cannot pickle.
    """


class AsyncExecutionError(AsyncRpcError, TypeError, RuntimeError):
    """An ``@async_execution`` function returned something that is not a future or a
    coroutine."""


class OperatorArgumentsError(AsyncRpcError, TypeError, RuntimeError):
    """A builtin torch op called through RPC did not take its arguments.

    A ``TypeError``, as the same call raises locally, and a ``RuntimeError`` in torch's
    words, as torch's RPC raises it for builtin ops.
    """


class FunctionNotFoundError(AsyncRpcError, LookupError, RuntimeError):
    """The callee could not import the function it was asked to run."""

    def __init__(self, function: str, worker: str, reason: str) -> None:
        super().__init__(function, worker, reason)
        self.function = function
        self.worker = worker
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"function {self.function} cannot be found on worker {self.worker!r} "
            f"({self.reason}); the RPC pickler does not serialize function code: define it "
            "at module level in a module importable on both the caller and the callee"
        )


# -- remote failures -----------------------------------------------------------------------


class RemoteError(AsyncRpcError, RuntimeError):
    """A remote exception that could not be rebuilt as its own type.

    Keeps the remote type's name, its message, the remote traceback and the worker.
    """

    def __init__(self, type_name: str, message: str, traceback: str, worker: str) -> None:
        super().__init__(type_name, message, traceback, worker)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = traceback
        self.remote_worker = worker

    def __str__(self) -> str:
        return (
            f"{self.type_name}: {self.message} (raised on worker {self.remote_worker!r}; "
            f"it could not be rebuilt here. Original exception on remote side was "
            f"{self.type_name})\n"
            f"Remote traceback:\n{self.remote_traceback}"
        )


class RpcTimeoutError(AsyncRpcError, TimeoutError, RuntimeError):
    """A call did not finish within its limit. Names the worker, the function and the limit."""

    def __init__(self, worker: str, function: str, timeout: float) -> None:
        super().__init__(worker, function, timeout)
        self.worker = worker
        self.function = function
        self.timeout = timeout

    def __str__(self) -> str:
        return (
            f"call to {self.function} on worker {self.worker!r} timed out after "
            f"{self.timeout:g} s (RPC ran for more than the set timeout)"
        )


# -- connections ---------------------------------------------------------------------------


class ClosedError(AsyncRpcError, ConnectionError, RuntimeError):
    """The connection or agent was closed by this side; nothing more can be sent on it."""


class ConnectionLostError(AsyncRpcError, ConnectionError, RuntimeError):
    """The network or the peer broke the connection (the cause is chained)."""


class PeerLostError(ConnectionLostError):
    """The connection to a named peer was lost: it died, or it closed on us."""

    def __init__(self, worker: str, reason: str = "connection lost") -> None:
        super().__init__(worker, reason)
        self.worker = worker
        self.reason = reason

    def __str__(self) -> str:
        return f"lost the connection to worker {self.worker!r}: {self.reason}"


class PeerUnavailableError(ConnectionLostError):
    """A connection to a named peer could not be opened."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(worker, reason)
        self.worker = worker
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot connect to worker {self.worker!r}: {self.reason}"


# -- protocol ------------------------------------------------------------------------------


class ProtocolError(AsyncRpcError):
    """The wire protocol was broken."""


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (a bug on this side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol; that connection is closed."""


class AuthenticationError(RemoteProtocolError, PermissionError):
    """The peer did not prove it holds the group's key; that connection is closed."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame is larger than the receiver's ``max_frame_size``.

    Raised by the receiver for a frame a peer announced (checked before allocating; that
    connection is closed), and by the sender, before writing a byte, for a message larger
    than the limit its peer declared in the handshake (``worker`` names that peer; the
    connection is untouched and the call fails alone).
    """

    def __init__(self, size: int, limit: int, worker: str | None = None) -> None:
        super().__init__(size, limit, worker)
        self.size = size
        self.limit = limit
        self.worker = worker

    def __str__(self) -> str:
        whose = "the" if self.worker is None else f"worker {self.worker!r}'s"
        return f"frame of {self.size} bytes exceeds {whose} maximum frame size ({self.limit} bytes)"


# -- remote references ---------------------------------------------------------------------


class CallbackError(AsyncRpcError, RuntimeError):
    """Base of what a ``Future.then`` callback's exception becomes: torch reports those as
    ``RuntimeError``. ``as_callback_error`` makes a copy that is both a ``RuntimeError`` and
    an instance of the exception's own type (``except TypeError`` still catches it); the
    original is its ``__cause__``."""


_callback_types: dict[type, type[BaseException]] = {}


def as_callback_error(exc: BaseException) -> BaseException:
    """Return ``exc`` as torch reports a callback's exception: also a ``RuntimeError``.

    A ``RuntimeError`` (or a ``BaseException`` that is no ``Exception``) is returned as is.
    Otherwise the copy's class derives from both ``type(exc)`` and ``CallbackError``,
    keeps ``args``, attributes, message and traceback, and pickles as that pair.
    """
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    try:
        copy = _rebuild_callback_error(type(exc), exc.args, getattr(exc, "__dict__", {}))
    except Exception:  # a class that cannot be paired (a layout conflict, a strict __new__)
        return exc
    copy.__cause__ = exc
    copy.__suppress_context__ = True
    return copy.with_traceback(exc.__traceback__)


def _callback_type(cls: type) -> type[BaseException]:
    dual = _callback_types.get(cls)
    if dual is None:
        namespace = {"__module__": cls.__module__, "__reduce__": _reduce_callback_error}
        dual = cast("type[BaseException]", type(cls.__name__, (cls, CallbackError), namespace))
        dual.__qualname__ = cls.__qualname__
        _callback_types[cls] = dual
    return dual


def _reduce_callback_error(self: BaseException) -> tuple[object, ...]:
    original = type(self).__mro__[1]
    return (_rebuild_callback_error, (original, self.args, dict(self.__dict__)))


def _rebuild_callback_error(
    cls: type, args: tuple[object, ...], state: dict[str, object]
) -> BaseException:
    dual = _callback_type(cls)
    try:
        copy: BaseException = dual(*args)  # __init__ sets what str() reads
    except Exception:  # an __init__ that does not take its own args back
        copy = dual.__new__(dual, *args)
        copy.args = args
    copy.__dict__.update(state)
    return copy


class AutogradContextError(AsyncRpcError, RuntimeError):
    """No distributed autograd context with that id on this worker (never seen, or
    released), or none is active where one is needed."""


class RRefError(AsyncRpcError, RuntimeError):
    """Misuse of an RRef (``local_value`` on a user, use after release...)."""


class RRefOwnerLostError(RRefError, ConnectionError):
    """The owner of an RRef is gone; the value cannot be reached any more."""

    def __init__(self, owner: str, reason: str = "owner unreachable") -> None:
        super().__init__(owner, reason)
        self.owner = owner
        self.reason = reason

    def __str__(self) -> str:
        return f"the owner {self.owner!r} of this RRef is gone: {self.reason}"


class RRefTimeoutError(RRefError, TimeoutError):
    """Creating the RRef's value timed out; the RRef is unusable from then on."""

    def __init__(self, owner: str, function: str, timeout: float) -> None:
        super().__init__(owner, function, timeout)
        self.owner = owner
        self.function = function
        self.timeout = timeout

    def __str__(self) -> str:
        return (
            f"remote() of {self.function} on worker {self.owner!r} timed out after "
            f"{self.timeout:g} s (RPC ran for more than the set timeout); this RRef is unusable"
        )
