"""``RRef``: a remote reference to a value owned by one worker (layer L3).

An RRef is either the owner's (``is_owner()``: the value lives here) or a user's (a fork
the owner counts). ``to_here()`` blocks like torch's; ``to_here_future()`` returns an
``asyncrpc.Future``, awaitable in async code. The proxies ``rpc_sync()``, ``rpc_async()``,
``remote()``, ``stream()`` and ``bidi()`` run a method of the value on its owner (they live
in ``proxies.py``); ``backward()`` runs autograd from a tensor value, locally or in a
distributed autograd context. Dropping the last Python object of
an RRef never does I/O: ``__del__`` hands the release to the agent's loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from asyncrpc.autograd import backward_async as dist_backward_async
from asyncrpc.errors import PeerLostError, RRefError, RRefOwnerLostError
from asyncrpc.protocol.options import UNSET_RPC_TIMEOUT, WorkerInfo
from asyncrpc.protocol.refmessages import ForkId, RRefId
from asyncrpc.rref.proxies import Proxy, ProxyCalls
from asyncrpc.rref.values import (
    backward_here,
    check_tensor,
    ignored,
    made,
    owned,
    owner_lost_as_rref_error,
    owner_value,
    type_of,
)
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.futures import Future, chain

__all__ = ["RRef", "RRefBackend", "RRefOps", "current_rrefs"]

T = TypeVar("T")


class RRefBackend(Protocol):
    """What an RRef asks of its worker's fork bookkeeping (``asyncrpc/rref/forks.py``)."""

    @property
    def rank(self) -> int: ...

    def worker_info(self, rank: int) -> WorkerInfo: ...

    def check_usable(self, rref: RRef[Any]) -> None: ...

    def confirmed(self, rref: RRef[Any]) -> bool: ...

    def schedule_release(self, rref_id: RRefId, fork_id: ForkId | None) -> None: ...

    def create_local(self, value: Any) -> tuple[RRefId, Future[Any]]: ...

    def owned_value(self, worker_id: int, local_id: int) -> Future[Any]: ...

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any: ...


class RRefOps(ProxyCalls, Protocol):
    """The RRef operations that make calls, of the current worker (``context.RRefs``): an
    RRef's state lives in its worker's fork bookkeeping; what it asks of other workers
    goes through the current worker's calls, as ``rpc_sync`` does (``call`` is the
    proxies' own, ``proxies.ProxyCalls``)."""

    @property
    def forks(self) -> RRefBackend: ...

    def remote(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None = ...,
    ) -> RRef[Any]: ...  # fmt: skip

    def call_sync(
        self, to: int, fn: Any, args: Sequence[Any], timeout: float, target: str
    ) -> Any: ...

    def off_loop(self) -> bool: ...

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any: ...

    def watch_owner(
        self, owner: int, callback: Callable[[PeerLostError], None]
    ) -> Callable[[], None]: ...


_RREFS: FeatureSlot[RRefOps] = FeatureSlot("rrefs", "RRefs")


def current_rrefs() -> RRefOps:
    """The current worker's RRef operations.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return _RREFS.get()


class RRef(Generic[T]):
    """A reference to a value of type ``T`` owned by one worker (torch's ``RRef``).

    ``RRef(value)`` makes an owner reference to a local value. ``RRef[T]`` works as a type.
    """

    __slots__ = (
        "__weakref__", "_ctx", "_fork_id", "_made_by", "_owner", "_rref_id", "_type", "_value",
    )  # fmt: skip

    _ctx: RRefBackend
    _rref_id: RRefId
    _fork_id: ForkId | None
    _owner: int
    _value: Future[T] | None
    _type: Future[type] | None
    # The remote() call that made this RRef, when it went through the call pipeline (a
    # profiled one): done once the hooks were told it ended.
    _made_by: Future[Any] | None

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        """Make an owner reference to ``value``.

        Args:
            value: the value, owned by this worker.
            type_hint: the value's type, as torch's constructor takes it (for TorchScript);
                ``_get_type`` answers with it.

        Raises:
            NotInitializedError: RPC is not initialized in this process.
        """
        self._ctx = current_rrefs().forks
        self._rref_id, self._value = self._ctx.create_local(value)
        self._fork_id, self._owner = None, self._ctx.rank
        self._type, self._made_by = None, None
        if type_hint is not None:
            self._type = Future()
            self._type.set_result(type_hint)

    @classmethod
    def _make(
        cls, ctx: RRefBackend, rref_id: RRefId, fork_id: ForkId | None, owner: int,
        value: Future[Any] | None,
    ) -> RRef[Any]:  # fmt: skip
        rref: RRef[Any] = object.__new__(cls)
        rref._ctx, rref._rref_id, rref._fork_id = ctx, rref_id, fork_id
        rref._owner, rref._value, rref._type, rref._made_by = owner, value, None, None
        return rref

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.schedule_release(self._rref_id, self._fork_id)

    def __reduce__(self) -> Any:
        raise RRefError(
            "Can not pickle rref in python pickler: an RRef can only be pickled by asyncrpc, "
            "as part of an RPC"
        )

    def __repr__(self) -> str:
        role = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{role}(rref_id={tuple(self._rref_id)}, owner={self.owner_name()!r})"

    def __str__(self) -> str:
        # torch's text for its RRefs, which code written for torch may parse or print.
        rref_id = _guid(self._rref_id)
        if self._fork_id is None:
            return f"OwnerRRef({rref_id})"
        return f"UserRRef(RRefId = {rref_id}, ForkId = {_guid(self._fork_id)})"

    # -- identity --------------------------------------------------------------------------

    def id(self) -> tuple[int, int]:
        """The RRef's id (creator rank, serial): its owner finds the value by it."""
        return tuple(self._rref_id)  # type: ignore[return-value]

    def is_owner(self) -> bool:
        """True when this worker owns the value."""
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        """``WorkerInfo`` of the owner."""
        return self._ctx.worker_info(self._owner)

    def owner_name(self) -> str:
        """Name of the owner."""
        return self._ctx.worker_info(self._owner).name

    def confirmed_by_owner(self) -> bool:
        """True once the owner has registered this reference (always True on the owner)."""
        return self._ctx.confirmed(self)

    def on_owner_lost(self, callback: Callable[[PeerLostError], None]) -> Callable[[], None]:
        """Call ``callback(error)`` once when this reference's owner is gone for good: lost
        (it died, hung or became unreachable) or shut down without waiting for this
        reference. The value is gone with it (``to_here()`` and proxies raise
        ``RRefOwnerLostError``); ``error`` is the owner's ``PeerLostError``, whose
        ``evidence`` says how it was found. At once if the owner is gone already; never
        on the owner itself. The callback runs on the callback pool (it may block, or make
        calls to other workers).

        Returns:
            A function that stops the callback.
        """
        if self._fork_id is None:  # the owner: its value ends with this worker
            return _no_watch
        return current_rrefs().watch_owner(self._owner, callback)

    # -- values ----------------------------------------------------------------------------

    def local_value(self) -> T:
        """The value itself; owner only. Waits if a ``remote()`` is still computing it.

        Returns:
            The very object the owner holds (no copy).

        Raises:
            RRefError: this worker is not the owner.
            Exception: the exception that creating the value raised.
        """
        if self._value is None:
            me, owner = self._ctx.worker_info(self._ctx.rank), self.owner()
            raise RRefError(
                f"local_value() is for the owner; this RRef is owned by {owner.name!r} (For "
                f"UserRRef(rref_id={_guid(self._rref_id)}, fork_id={_guid(self._fork_id)}), "
                f"can't call localValue() on user {me}. Call it on owner {owner})"
            )
        return cast(T, owned(self._value).wait())

    def to_here_future(self, timeout: float = UNSET_RPC_TIMEOUT) -> Future[T]:
        """Fetch a copy of the value; returns a Future (``await`` it, or ``.wait()``).

        Args:
            timeout: seconds; -1 means the default rpc timeout, 0 none.

        Returns:
            A Future of the value (on the owner, of the value itself).

        Raises:
            RRefOwnerLostError: the owner is gone (also through the future).
            RRefTimeoutError: the remote() that made this RRef timed out.
        """
        return self._fetch(timeout, CallKind.ASYNC)

    def _fetch(self, timeout: float, kind: CallKind) -> Future[T]:
        ctx = self._ctx
        ctx.check_usable(self)
        if self._value is not None:
            return owned(self._value)
        if self._rref_id.worker == ctx.rank:
            # We made it with remote(): fetch by id, not by pickling the RRef, whose fork
            # to the owner costs an acknowledgement frame and bookkeeping on both sides.
            # Frames to one peer arrive in order, so the owner has read our remote().
            ops = current_rrefs()
            call = ops.call(self._owner, _fetch, tuple(self._rref_id), timeout, kind, _TO_HERE)
        else:
            # Made by another worker: its remote() may still be on the way to the owner
            # (a large frame, another connection); the pickled fork waits for the value.
            ops = current_rrefs()
            call = ops.call(self._owner, _fetch_forked, (self,), timeout, kind, _TO_HERE)
        # The callback holds this RRef until the reply: its release (a message behind the
        # fetch) must not let the owner free the value before the fetch has read it.
        return chain(call, functools.partial(_fetched, self.owner_name(), self))

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """Fetch a copy of the value, blocking (torch's ``to_here``).

        In async code use ``await rref.to_here_future()``.

        Args:
            timeout: seconds; -1 means the default rpc timeout, 0 none.

        Returns:
            A copy of the value (on the owner, the value itself).

        Raises:
            BlockingCallError: called on the agent's loop thread before the value is here.
            Exception: the errors of ``to_here_future`` and the exception creating the
                value raised, as its own type.
        """
        ctx = self._ctx
        if self._value is None and self._rref_id.worker == ctx.rank:
            ops = current_rrefs()
            if ops.off_loop():
                # We made it: fetch it by id with a synchronous call, which takes this
                # thread's lane to the owner when it has one (the owner waits for the value
                # there, and for its remote() if that is still on its way).
                ctx.check_usable(self)
                try:
                    return cast(T, ops.call_sync(self._owner, _fetch_now, tuple(self._rref_id),
                                                 timeout, _TO_HERE))  # fmt: skip
                except PeerLostError as exc:
                    raise RRefOwnerLostError(self.owner_name(), str(exc)) from exc
        return self._fetch(timeout, CallKind.SYNC).wait()

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (torch's ``RRef._get_type``), asked of the owner once.

        Args:
            timeout: seconds for the owner to answer; -1 means the default rpc timeout.
            blocking: True returns the type; False a Future of it (the same Future on every
                call once asked).

        Raises:
            RpcTimeoutError: the owner did not answer in time (the next call asks again).
            The exception that creating the value raised.
        """
        fut = self._type
        if fut is None or (fut.done() and fut.exception() is not None):
            if self._value is not None:
                fut = chain(self._value, type_of)
            else:
                self._ctx.check_usable(self)
                call = current_rrefs().call(
                    self._owner, _type_on_owner, (self,), timeout, CallKind.ASYNC, "RRef._get_type"
                )
                fut = chain(call, functools.partial(owner_lost_as_rref_error, self.owner_name()))
            self._type = fut
        return fut.wait() if blocking else fut

    def _get_future(self) -> Future[None]:
        """A future done once the owner has made the value (torch's ``RRef._get_future``).

        Returns:
            A Future of None; it fails as making the value failed (a timed-out ``remote()``
            fails it with ``RRefTimeoutError``). No copy of the value travels.

        Cancellation: cancelling it leaves the value be.
        """
        if self._value is not None:
            return chain(self._value, made)
        try:
            self._ctx.check_usable(self)
        except RRefError as exc:
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return failed
        call = current_rrefs().call(
            self._owner,
            _made_on_owner,
            (self,),
            UNSET_RPC_TIMEOUT,
            CallKind.ASYNC,
            "RRef._get_future",
        )
        return chain(call, functools.partial(owner_lost_as_rref_error, self.owner_name()))

    def _get_profiling_future(self) -> Future[None]:
        """A future done once the profiler has the span of the ``remote()`` that made this
        RRef, and what the owner recorded (torch's ``RRef._get_profiling_future``).

        Returns:
            A Future of None, done at once for an RRef not made by a profiled ``remote()``.
            It never fails: a failed ``remote()`` has its span too.

        Cancellation: cancelling it changes nothing else.
        """
        made_by = self._made_by
        if made_by is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return chain(made_by, ignored)

    # -- autograd --------------------------------------------------------------------------

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value, a scalar tensor (torch's ``RRef.backward``).

        On the owner with ``dist_autograd_ctx_id=-1`` this is local autograd (gradients
        accumulate into ``.grad``); with a context id it is a distributed backward pass from
        the owner in that context. A user RRef runs the pass on the owner, in the context
        given (which the owner must have joined), and blocks until it is done.

        Args:
            dist_autograd_ctx_id: the distributed autograd context, or -1 (owner only).
            retain_graph: keep the graph for another backward, as in torch.

        Raises:
            RRefError: the value is not a tensor, or a user RRef got no context id.
            AutogradContextError: no such context on the owner.
            The errors of ``torch.autograd.backward`` or ``autograd.backward``.
        """
        if self._value is not None:
            backward_here(self._value.wait(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RRefError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified: only the owner "
                f"({self.owner_name()!r}) can run local autograd on the value"
            )
        self._ctx.check_usable(self)
        args = (self, dist_autograd_ctx_id, retain_graph)
        call = current_rrefs().call(
            self._owner, _backward_on_owner, args, UNSET_RPC_TIMEOUT, CallKind.SYNC, "RRef.backward"
        )
        chain(call, functools.partial(owner_lost_as_rref_error, self.owner_name())).wait()

    # -- proxies ---------------------------------------------------------------------------

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_sync().method(*args)`` runs ``value.method`` on the owner.

        Args:
            timeout: seconds for each call made through the proxy; -1 means the default
                ``rpc_timeout``, 0 none.

        Returns:
            A proxy whose method calls block for the result, as ``rpc_sync``.
        """
        return Proxy(self, CallKind.SYNC, timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_async().method(*args)`` returns a Future of the result.

        Args:
            timeout: seconds for each call made through the proxy; -1 means the default
                ``rpc_timeout``, 0 none.

        Returns:
            A proxy whose method calls return a ``Future``, as ``rpc_async``.
        """
        return Proxy(self, CallKind.ASYNC, timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.remote().method(*args)`` returns an RRef of the result.

        As torch's, the proxy first checks that the value's type has ``method``.

        Args:
            timeout: seconds for each ``remote`` made through the proxy; -1 means the
                default ``rpc_timeout``, 0 none.

        Returns:
            A proxy whose method calls return an ``RRef`` owned by this RRef's owner.
        """
        return Proxy(self, CallKind.REMOTE, timeout)

    def stream(
        self, timeout: float = UNSET_RPC_TIMEOUT, window: int | None = None,
        window_bytes: int | None = None,
    ) -> Any:  # fmt: skip
        """Proxy: ``rref.stream().method(*args)`` iterates the generator method ``method``
        of the value on its owner, as ``asyncrpc.rpc_stream`` does.

        Args:
            timeout: seconds each wait for the next item may last; -1 means the default
                ``rpc_timeout``, 0 none.
            window: items the producer may run ahead (default:
                ``RpcBackendOptions.stream_window``).
            window_bytes: bytes the producer may run ahead, as ``rpc_stream``'s (default:
                ``RpcBackendOptions.stream_window_bytes``; 0: items only).

        Returns:
            A proxy whose method calls return a ``Stream``.
        """
        return Proxy(self, CallKind.STREAM, timeout, (window, window_bytes))

    def bidi(
        self, timeout: float = UNSET_RPC_TIMEOUT, window: int | None = None,
        window_bytes: int | None = None,
    ) -> Any:  # fmt: skip
        """Proxy: ``rref.bidi().method(*args)`` opens a bidirectional stream with the
        method ``method`` of the value on its owner, as ``asyncrpc.rpc_bidi`` does: the
        method takes the requests first and yields replies.

        Args:
            timeout: seconds each wait for a reply here, or for a request on the owner,
                may last; -1 means the default ``rpc_timeout``, 0 none.
            window: items each side may run ahead (default:
                ``RpcBackendOptions.stream_window``).
            window_bytes: bytes each side may run ahead, as ``rpc_bidi``'s.

        Returns:
            A proxy whose method calls return a ``Bidi``.
        """
        return Proxy(self, CallKind.STREAM, timeout, (window, window_bytes), bidi=True)


_TO_HERE = "RRef.to_here"  # the name of fetches, for the hooks (and the profiler)


def _fetched(owner: str, rref: RRef[Any], done: Future[Any]) -> Any:
    del rref  # held only until the reply came
    return owner_lost_as_rref_error(owner, done)


async def _fetch_forked(rref: RRef[Any]) -> Any:
    """Runs on the owner: the value behind ``rref`` (unpickled here as the owner's own)."""
    value = rref._value
    assert value is not None
    del rref  # see owner_value: no frame of a failing fetch may hold the handle
    return await owner_value(value)


def _guid(key: RRefId | ForkId | None) -> str:
    # An id as torch prints its GloballyUniqueId.
    return "None" if key is None else f"GloballyUniqueId(created_on={key[0]}, local_id={key[1]})"


async def _made_on_owner(rref: RRef[Any]) -> None:
    """Runs on the owner: returns once the value behind ``rref`` is made."""
    value = rref._value
    assert value is not None
    del rref  # see owner_value
    await owner_value(value)


async def _type_on_owner(rref: RRef[Any]) -> type:
    """Runs on the owner: the type of the value behind ``rref``."""
    value = rref._value
    assert value is not None
    del rref  # see owner_value
    return type(await owner_value(value))


async def _backward_on_owner(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """Runs on the owner: the distributed backward pass from the value behind ``rref``."""
    future = rref._value
    assert future is not None
    del rref  # see owner_value
    value = await owner_value(future)
    check_tensor(value)
    await dist_backward_async(context_id, [value], retain_graph)


def _fetch_now(worker_id: int, local_id: int) -> Any:
    """Runs on the owner, on a lane's thread (or a pool's): the value of the RRef with this
    id, waited for here; a failure is raised as a copy (see ``owner_value``)."""
    return owned(current_rrefs().forks.owned_value(worker_id, local_id)).wait()


async def _fetch(worker_id: int, local_id: int) -> Any:
    """Runs on the owner: the value of the RRef with this id, once it exists.

    The caller holds a user reference until the reply, so the owner still counts it (or
    the parent fork that is handing it over) and has not freed the value.
    """
    return await owner_value(current_rrefs().forks.owned_value(worker_id, local_id))


def _no_watch() -> None:
    """The stop function of a watch that can never fire."""
