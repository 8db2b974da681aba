"""``RRef``: a remote reference to a value owned by one worker (layer L3).

An RRef is either the owner's (``is_owner()``: the value lives here) or a user's (a fork
the owner counts). ``to_here()`` blocks like torch's; ``to_here_future()`` returns an
``asyncrpc.Future``, awaitable in async code. The proxies ``rpc_sync()``, ``rpc_async()``
and ``remote()`` run a method of the value on its owner. Dropping the last Python object of
an RRef never does I/O: ``__del__`` hands the release to the agent's loop.
"""

from __future__ import annotations

import copy
import functools
import traceback
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from asyncrpc.runtime.current import current_agent
from asyncrpc.errors import PeerLostError, RRefError, RRefOwnerLostError
from asyncrpc.functions import is_async_execution, is_coroutine_function, is_inline
from asyncrpc.runtime.future import Future
from asyncrpc.runtime.options import UNSET_RPC_TIMEOUT, WorkerInfo

if TYPE_CHECKING:
    from asyncrpc.protocol.refcount import ForkId, RRefId
    from asyncrpc.rref.context import RRefContext

__all__ = ["RRef"]

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value of type ``T`` owned by one worker (torch's ``RRef``).

    ``RRef(value)`` makes an owner reference to a local value. ``RRef[T]`` works as a type.
    """

    __slots__ = ("__weakref__", "_ctx", "_fork_id", "_owner", "_rref_id", "_value")

    _ctx: RRefContext
    _rref_id: RRefId
    _fork_id: ForkId | None
    _owner: int
    _value: Future[T] | None

    def __init__(self, value: T) -> None:
        agent = current_agent()
        assert agent.rrefs is not None  # set once the agent has joined its group
        self._ctx = agent.rrefs
        self._rref_id, self._value = self._ctx.create_local(value)
        self._fork_id, self._owner = None, agent.rank

    @classmethod
    def _make(
        cls, ctx: RRefContext, rref_id: RRefId, fork_id: ForkId | None, owner: int,
        value: Future[Any] | None,
    ) -> RRef[Any]:  # fmt: skip
        rref: RRef[Any] = object.__new__(cls)
        rref._ctx, rref._rref_id, rref._fork_id = ctx, rref_id, fork_id
        rref._owner, rref._value = owner, value
        return rref

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.schedule_release(self._rref_id, self._fork_id)

    def __reduce__(self) -> Any:
        raise RRefError("an RRef can only be pickled by asyncrpc, as part of an RPC")

    def __repr__(self) -> str:
        role = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{role}(rref_id={tuple(self._rref_id)}, owner={self.owner_name()!r})"

    # -- identity --------------------------------------------------------------------------

    def is_owner(self) -> bool:
        """True when this worker owns the value."""
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        """``WorkerInfo`` of the owner."""
        return self._ctx.agent.worker_info(self._owner)

    def owner_name(self) -> str:
        """Name of the owner."""
        return self._ctx.agent.addresses[self._owner].name

    def confirmed_by_owner(self) -> bool:
        """True once the owner has registered this reference (always True on the owner)."""
        return self._ctx.confirmed(self)

    # -- values ----------------------------------------------------------------------------

    def local_value(self) -> T:
        """The value itself; owner only. Waits if a ``remote()`` is still computing it.

        Raises:
            RRefError: this worker is not the owner.
            The exception that creating the value raised.
        """
        if self._value is None:
            raise RRefError(
                f"local_value() is for the owner; this RRef is owned by {self.owner_name()!r}"
            )
        return self._value.wait()

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
        self._ctx.check_usable(self)
        if self._value is not None:
            return self._value
        agent = self._ctx.agent
        if self._rref_id.worker == agent.rank:
            # We made it with remote(): fetch by id, not by pickling the RRef, whose fork
            # to the owner costs an acknowledgement frame and bookkeeping on both sides.
            # Frames to one peer arrive in order, so the owner has read our remote().
            call = agent.call_future(self._owner, _fetch, tuple(self._rref_id), {}, timeout)
        else:
            # Made by another worker: its remote() may still be on the way to the owner
            # (a large frame, another connection); the pickled fork waits for the value.
            call = agent.call_future(self._owner, _fetch_forked, (self,), {}, timeout)
        # The callback holds this RRef until the reply: its release (a message behind the
        # fetch) must not let the owner free the value before the fetch has read it.
        return call.then(functools.partial(_fetched, self.owner_name(), self))

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """Fetch a copy of the value, blocking (torch's ``to_here``).

        In async code use ``await rref.to_here_future()``.

        Raises:
            BlockingCallError: called on the agent's loop thread before the value is here.
            The errors of ``to_here_future`` and the exception creating the value raised.
        """
        return self.to_here_future(timeout).wait()

    # -- proxies ---------------------------------------------------------------------------

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_sync().method(*args)`` runs ``value.method`` on the owner."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.rpc_async().method(*args)`` returns a Future of the result."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Proxy: ``rref.remote().method(*args)`` returns an RRef of the result."""
        return _Proxy(self, "remote", timeout)


class _Proxy:
    """Turns ``proxy.method(*args, **kwargs)`` into a call of ``method`` on the owner."""

    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(self._invoke, name)

    def _invoke(self, name: str, *args: Any, **kwargs: Any) -> Any:
        rref = self._rref
        rref._ctx.check_usable(rref)
        agent = rref._ctx.agent
        call_args = (rref, name, args, kwargs)
        if self._mode == "remote":
            return rref._ctx.remote(rref._owner, _invoke_method, call_args, {}, self._timeout)
        future = agent.call_future(rref._owner, _invoke_method, call_args, {}, self._timeout)
        future = future.then(functools.partial(_owner_lost_as_rref_error, rref.owner_name()))
        return future if self._mode == "async" else future.wait()


def _owner_lost_as_rref_error(owner: str, done: Future[Any]) -> Any:
    exc = done.exception()
    if isinstance(exc, PeerLostError):
        raise RRefOwnerLostError(owner, str(exc)) from exc
    return done.value()


async def _owner_value(value: Future[Any]) -> Any:
    """Await an owner's value; a failure is raised as a copy.

    The stored exception is shared by every consumer: re-raising it would chain each
    consumer's frames (and the RRefs in them) onto it, and so keep the value alive forever.
    """
    try:
        return await value
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise copy.copy(exc).with_traceback(None) from None


def _fetched(owner: str, rref: RRef[Any], done: Future[Any]) -> Any:
    del rref  # held only until the reply came
    return _owner_lost_as_rref_error(owner, done)


async def _fetch_forked(rref: RRef[Any]) -> Any:
    """Runs on the owner: the value behind ``rref`` (unpickled here as the owner's own)."""
    value = rref._value
    assert value is not None
    del rref  # see _owner_value: no frame of a failing fetch may hold the handle
    return await _owner_value(value)


async def _fetch(worker_id: int, local_id: int) -> Any:
    """Runs on the owner: the value of the RRef with this id, once it exists.

    The caller holds a user reference until the reply, so the owner still counts it (or
    the parent fork that is handing it over) and has not freed the value.
    """
    ctx = current_agent().rrefs
    assert ctx is not None
    return await _owner_value(ctx.owned_value(worker_id, local_id))


async def _invoke_method(
    rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Runs on the owner: ``value.name(*args, **kwargs)``.

    ``async def``, ``async_execution`` and ``@inline`` methods run on the loop; plain
    methods on the agent's thread pool, so a slow method never stalls the loop.
    """
    future, agent = rref._value, rref._ctx.agent
    assert future is not None
    del rref  # see _owner_value
    value = await _owner_value(future)
    method = getattr(value, name)
    if is_coroutine_function(method):
        return await method(*args, **kwargs)
    if not (is_inline(method) or is_async_execution(method)):
        return await agent.pool.run(functools.partial(method, *args, **kwargs))
    result = method(*args, **kwargs)  # on the loop: it returns at once
    if is_async_execution(method):
        from asyncrpc.runtime.dispatch import await_async_result

        return await await_async_result(result)
    return result
