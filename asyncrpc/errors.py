"""The exception tree of asyncrpc, rooted at ``AsyncRpcError`` (layer L0: standard library
only). A few errors of one part live beside it, in this tree all the same
(``FutureNotDoneError``, ``StreamPoolExhaustedError``, ``DeviceMapError``,
``MissingReferenceError``, the ``nn`` errors).

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

from asyncrpc.errorstate import paired_copy

__all__ = [
    "AsyncExecutionError",
    "AsyncRpcError",
    "AuthenticationError",
    "AutogradContextError",
    "BackwardError",
    "BadDestinationError",
    "BlockingCallError",
    "CallbackError",
    "ClosedError",
    "ConnectionLostError",
    "DuplicateNameError",
    "DuplicateRankError",
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
    "RemoteCallError",
    "RemoteError",
    "RemoteProtocolError",
    "RendezvousTimeoutError",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "ShutdownTimeoutError",
    "StoreHostLostError",
    "StreamArgError",
    "ThreadPoolExhaustedError",
    "TorchScriptCallError",
    "UnknownWorkerError",
    "WorkerNameError",
    "WorkersLostError",
    "WorldSizeMismatchError",
    "as_backward_error",
    "as_callback_error",
    "as_remote_call_error",
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


class WorldSizeMismatchError(InitError, ValueError):
    """Members of a static group were started with different ``world_size`` values.

    Raised on every member that reaches the rendezvous: the first to see the difference
    aborts the group, naming both ranks and both values.
    """

    def __init__(self, rank: int, world_size: int, other_rank: int, other_size: int) -> None:
        super().__init__(rank, world_size, other_rank, other_size)
        self.rank = rank
        self.world_size = world_size
        self.other_rank = other_rank
        self.other_size = other_size

    def __str__(self) -> str:
        return (
            f"world_size differs between ranks: rank {self.rank} says "
            f"world_size={self.world_size}, rank {self.other_rank} says {self.other_size}"
        )


class DuplicateNameError(InitError, ValueError):
    """Two workers of a group were given the same name (raised on every member of a static
    group that is still joining, and on the newcomer of a dynamic one)."""

    def __init__(self, name: str, rank: int, holder_rank: int) -> None:
        super().__init__(name, rank, holder_rank)
        self.name = name
        self.rank = rank
        self.holder_rank = holder_rank

    def __str__(self) -> str:
        return (
            f"worker name {self.name!r} is not unique: rank {self.rank} and rank "
            f"{self.holder_rank} both use it"
        )


class DuplicateRankError(InitError, ValueError):
    """Two workers of a group were given the same rank (raised like ``DuplicateNameError``)."""

    def __init__(self, rank: int, name: str, holder_name: str) -> None:
        super().__init__(rank, name, holder_name)
        self.rank = rank
        self.name = name
        self.holder_name = holder_name

    def __str__(self) -> str:
        return (
            f"rank {self.rank} is not unique: workers {self.name!r} and "
            f"{self.holder_name!r} both claim it"
        )


class StoreHostLostError(InitError, ConnectionError):
    """The rendezvous store went away while this worker was joining: its host (rank 0 with
    ``tcp://`` and ``env://``) died or left during start-up."""

    def __init__(self, init_method: str, reason: str) -> None:
        super().__init__(init_method, reason)
        self.init_method = init_method
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"the rendezvous store at {self.init_method} is gone while joining the group: "
            f"its host (rank 0) died or left during start-up ({self.reason})"
        )


class RendezvousTimeoutError(InitError, TimeoutError):
    """Members of a static group did not all come within the rendezvous timeout (one was
    never started, or failed before it joined).

    Raised on every member still joining, naming the missing ranks: the first to give up
    posts it in the store, as ``WorldSizeMismatchError`` is posted.
    """

    def __init__(
        self, rank: int, world_size: int, timeout: float, missing: list[int], what: str
    ) -> None:
        super().__init__(rank, world_size, timeout, missing, what)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.missing = missing
        self.what = what

    def __str__(self) -> str:
        ranks = ", ".join(str(r) for r in self.missing)
        return (
            f"timed out after {self.timeout:g} s {self.what}: "
            f"{'rank' if len(self.missing) == 1 else 'ranks'} {ranks} of "
            f"world_size={self.world_size} never came (rank {self.rank} gave up waiting)"
        )


class NotInitializedError(AsyncRpcError, RuntimeError):
    """An RPC API was used before ``init_rpc`` or after ``shutdown``."""


class NotServingError(AsyncRpcError, RuntimeError):
    """Something only a function served for a peer can ask was asked elsewhere (for
    instance ``asyncrpc.on_caller_lost`` with no caller)."""


class ShutdownError(AsyncRpcError, RuntimeError):
    """A graceful shutdown could not complete (the rendezvous store went away, the time
    given ran out, or workers died and ``lost_workers="error"`` asked to hear of it)."""


class ShutdownTimeoutError(ShutdownError, TimeoutError):
    """A bounded graceful shutdown ran out of time waiting for the named workers.

    A shutdown waits without limit unless ``RpcBackendOptions.shutdown_timeout`` or
    ``shutdown(timeout=...)`` bounds it.
    """

    def __init__(self, limit: float, waiting_for: str, stage: str) -> None:
        super().__init__(limit, waiting_for, stage)
        self.limit, self.waiting_for, self.stage = limit, waiting_for, stage

    def __str__(self) -> str:
        return (
            f"shutdown timed out after {self.limit:g} s waiting for {self.waiting_for} "
            f"({self.stage}); the bound comes from shutdown(timeout=...) or "
            "RpcBackendOptions.shutdown_timeout: raise it, or pass 0 or None to wait "
            "without limit (the default)"
        )


class WorkersLostError(ShutdownError):
    """Workers died during the job; the survivors shut down without them.

    Raised by ``shutdown()`` after the survivors' barrier, only with
    ``RpcBackendOptions.lost_workers="error"`` (the default logs a warning instead).
    ``workers`` names the dead ones.
    """

    def __init__(self, workers: tuple[str, ...]) -> None:
        super().__init__(workers)
        self.workers = tuple(workers)

    def __str__(self) -> str:
        names = ", ".join(repr(w) for w in self.workers)
        return f"worker(s) {names} died before shutdown; the others shut down without them"


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


class TorchScriptCallError(AsyncRpcError, NotImplementedError):
    """A ``torch.jit.script`` function calls asyncrpc's ``rpc_sync``, ``rpc_async`` or
    ``remote``; raised while it is scripted.

    TorchScript (deprecated) compiles torch's own RPC calls into its C++ agent's ops and
    cannot compile asyncrpc's Python ones. A scripted function can still be what a call
    runs (``rpc_sync(to, scripted_fn, args)``). A ``NotImplementedError``, so also a
    ``RuntimeError``.
    """

    def __init__(self, function: str) -> None:
        super().__init__(function)
        self.function = function

    def __str__(self) -> str:
        return (
            f"asyncrpc does not support calling RPC from TorchScript: {self.function} is "
            "called inside a torch.jit.script function. Call it from Python (a scripted "
            "function can still be the function a call runs), or keep "
            "torch.distributed.rpc for scripted code"
        )


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


class RemoteCallError(AsyncRpcError, RuntimeError):
    """Base of what an exception raised by a remote function becomes on the caller.

    torch's handlers catch a remote failure as ``RuntimeError``; asyncio users expect the
    original type. ``as_remote_call_error`` makes the rebuilt exception both: its class
    derives from the original type and from this one (``except KeyError`` and
    ``except RuntimeError`` both catch a remote ``KeyError``), keeping ``args``, attributes,
    message, ``remote_worker`` and ``remote_traceback``. A remote ``RuntimeError`` (our own
    errors among them) stays as it is.
    """


def as_remote_call_error(exc: BaseException) -> BaseException:
    """Return the rebuilt remote exception ``exc`` as one that is also a ``RuntimeError``.

    A ``RuntimeError``, or a ``BaseException`` that is no ``Exception``, is returned as is;
    so is an exception whose class cannot be paired (a layout conflict, a strict
    ``__new__``): it keeps its own type rather than losing it.

    Args:
        exc: the exception as unpickled from the callee's reply.

    Returns:
        A copy whose class derives from ``type(exc)`` and ``RemoteCallError``, with the
        same ``args`` and attributes; or ``exc`` itself in the cases above.
    """
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    # No local cause: the original was raised on another worker, and its traceback is in
    # the remote_traceback attribute and the note, which the copy keeps.
    return paired_copy(exc, RemoteCallError, {}, chain=False) or exc


class RemoteError(RemoteCallError):
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


class StreamArgError(AsyncRpcError, LookupError, RuntimeError):
    """A stream argument (``asyncrpc.stream_arg``, a ``bidi`` stream's requests) could not
    be read: it was read already (once is all), it expired unread, or its sender shut
    down."""


# -- connections ---------------------------------------------------------------------------


class ClosedError(AsyncRpcError, ConnectionError, RuntimeError):
    """The connection or agent was closed by this side; nothing more can be sent on it."""


class ConnectionLostError(AsyncRpcError, ConnectionError, RuntimeError):
    """The network or the peer broke the connection (the cause is chained)."""


class PeerLostError(ConnectionLostError):
    """The connection to a named peer was lost: it died, or it closed on us.

    ``evidence`` says how a peer lost for good was found: ``"silence"`` (no byte on its
    connection for the heartbeat's limit, and, where it could be probed, no answer from its
    process either), ``"redial_refused"`` (its connection broke and redials were refused),
    ``"goodbye"`` (it shut down); empty for a connection lost with the peer still reachable.
    """

    def __init__(self, worker: str, reason: str = "connection lost", evidence: str = "") -> None:
        super().__init__(worker, reason, evidence)
        self.worker = worker
        self.reason = reason
        self.evidence = evidence

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


def as_callback_error(exc: BaseException) -> BaseException:
    """Return ``exc`` as torch reports a callback's exception: also a ``RuntimeError``.

    A ``RuntimeError`` (or a ``BaseException`` that is no ``Exception``) is returned as is.
    Otherwise the copy's class derives from both ``type(exc)`` and ``CallbackError``,
    keeps ``args``, attributes, message and traceback, and pickles as that pair.

    Args:
        exc: what a ``then`` callback raised.

    Returns:
        The copy (its ``__cause__`` is ``exc``), or ``exc`` itself as said above.
    """
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    return paired_copy(exc, CallbackError, {}) or exc


class AutogradContextError(AsyncRpcError, RuntimeError):
    """No distributed autograd context with that id on this worker (never seen, or
    released), or none is active where one is needed."""


class BackwardError(AsyncRpcError, RuntimeError):
    """An error raised in one worker's part of a distributed backward pass, as torch reports
    it: a ``RuntimeError`` whose text starts with ``Error on Node N:``, N that worker's rank
    (``node``). ``as_backward_error`` makes a copy that is also an instance of the error's
    own type (``except KeyError`` still catches it); the original is its ``__cause__``."""

    node: int = -1

    def __str__(self) -> str:
        return self.wrap_text(super().__str__())

    def wrap_text(self, text: str) -> str:
        return f"Error on Node {self.node}: {text}"


def as_backward_error(exc: BaseException, node: int) -> BaseException:
    """Return ``exc``, raised in worker ``node``'s part of a backward pass, as torch reports
    it: also a ``BackwardError`` (so a ``RuntimeError``) saying ``Error on Node {node}``.

    A ``BackwardError`` (from a deeper worker) or a ``BaseException`` that is no
    ``Exception`` is returned as is. Where the two types cannot be paired (a
    ``RuntimeError`` of its own already), a plain ``BackwardError`` with the same text.

    Args:
        exc: the error raised in that worker's part of the pass.
        node: that worker's rank.

    Returns:
        The paired copy (``node`` set, ``exc`` its ``__cause__``), a plain
        ``BackwardError``, or ``exc`` itself, as said above.
    """
    if isinstance(exc, BackwardError) or not isinstance(exc, Exception):
        return exc
    paired = paired_copy(exc, BackwardError, {"node": node})
    if paired is None:
        paired = BackwardError(str(exc))
        paired.node = node
        paired.__cause__ = exc
    return paired


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
