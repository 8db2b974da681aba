"""A request this worker serves, and what serving one needs around it (layer L2.4).

``ServedRequest`` is the record of one request from its arrival until its reply is
written; the protocols name what the dispatcher (``dispatch.py``) drives (the caller's
connection, the owner of ``remote()`` values, the stream producers); the functions are
shared with the lanes' server, which serves requests on its own threads: how an
``async_execution`` result is awaited, what a missing function becomes, how an error is
printed on the callee.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from asyncrpc.errors import AsyncExecutionError, FunctionNotFoundError, SerializationError
from asyncrpc.protocol.serde import MissingReferenceError
from asyncrpc.protocol.wire.messages import CallMode, Request
from asyncrpc.runtime.calls.deadline import deadline_after
from asyncrpc.runtime.calls.pipeline import IncomingCall, ItemReady, StreamLinks
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.futures.bridge import CFuture
from asyncrpc.runtime.threads.pool import Job as PoolJob

__all__ = [
    "CANCEL_GRACE_S",
    "Caller",
    "OwnerValues",
    "Producers",
    "Runner",
    "ServedRequest",
    "Writer",
    "await_async_result",
    "is_future_like",
    "missing_reference_error",
    "print_request_error",
]

# What runs a request: a task on the loop or a job in the pool (for cancellation).
Runner = asyncio.Task[Any] | PoolJob


class Caller(Protocol):
    """The side of a connection the dispatcher needs: who sent the request."""

    peer: int | None
    peer_name: str | None


class OwnerValues(Protocol):
    """What the dispatcher asks of the RRef layer (``asyncrpc/rref/forks.py``, above it):
    the values of ``remote()`` requests, and the forks that requests and replies carry."""

    def on_remote_request(self, peer: int, request: Request) -> None:
        """A remote() request arrived: register the caller's fork before it runs."""

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        """Its function finished: its value (or exception) is the owner's."""

    def expire_value(self, request: Request) -> bool:
        """Its timeout passed: fail its value unless it is made; whether it failed it."""

    def take_unconfirmed(self) -> Any:
        """A future done once the forks unpickled since the last call are confirmed by
        their owners (None: all are)."""

    def undelivered(self, rank: int, forks: list[Any]) -> None:
        """The frame carrying these forks to ``rank`` was never written."""


class Producers(Protocol):
    """What the dispatcher asks of the producing side of streams (``calls/streams/``,
    above it): hold a stream request's credit, forget it, start its generator."""

    def expect(
        self, conn: Any, peer: int, stream_id: int, target: str, timeout: float = 0.0,
        deadline: float | None = None,
    ) -> None: ...  # fmt: skip

    def forget(self, peer: int, stream_id: int) -> None: ...

    def start(
        self, peer: int, stream_id: int, fn: Any, run: Callable[..., Any], args: Any,
        kwargs: Any, replying: Callable[[bool, Any], dict[str, Any] | None],
        dumps: Callable[[Any], Any], fields: Callable[[], dict[str, Any] | None] | None = None,
        ready: ItemReady | None = None, links: StreamLinks | None = None,
    ) -> None: ...  # fmt: skip


# Writes a reply frame on the connection its request came on (the network's ``write``,
# through the lanes' reply writer; a closed connection drops it).
Writer = Callable[[Any, list[Any], object, Any], None]


async def await_async_result(result: Any) -> Any:
    """Await whatever an ``async_execution`` function returned, on the agent's loop.

    Raises:
        AsyncExecutionError: ``result`` is no future and no coroutine; the dispatcher
            replies with it, as with any exception the function raised.
    """
    if isinstance(result, Future):
        return await result
    if asyncio.isfuture(result) or asyncio.iscoroutine(result):
        return await result
    if isinstance(result, concurrent.futures.Future):
        return await asyncio.wrap_future(result)
    # Any torch future: a torch.futures.Future, and the bare torch._C.Future its then()
    # returns (pytorch/examples' batch RL agent returns `self.future_actions.then(...)`).
    if isinstance(result, CFuture):
        return await Future.from_torch(result)
    raise AsyncExecutionError(
        f"an @async_execution function must return a future or a coroutine, got "
        f"{type(result).__name__} (Functions decorated with @rpc.async_function must return "
        "a torch.futures.Future object, or with asyncrpc a coroutine)"
    )


def missing_reference_error(name: str, request: Request, exc: MissingReferenceError) -> Exception:
    """What the caller gets when worker ``name`` cannot import what a request names."""
    missing = f"{exc.module}.{exc.qualname}"
    if request.target.endswith(exc.qualname):
        return FunctionNotFoundError(missing, name, exc.reason)
    return SerializationError(
        f"{missing} (used by the arguments of {request.target}) cannot be imported on worker "
        f"{name!r}: {exc.reason}"
    )


def print_request_error(
    name: str, request: Request, caller: str | None, exc: BaseException
) -> None:
    """Print, on worker ``name``'s stderr, what a request it ran raised.

    As torch's agent does: the callee's own log shows what failed there (the caller gets
    the exception too). ``sys.stderr`` is looked up now: it may have been replaced.
    """
    lines = traceback.format_exception(exc)
    text = f"On worker {name!r}, {request.target} called by {caller!r} raised:\n"
    print(text + "".join(lines), end="", file=sys.stderr, flush=True)


def is_future_like(value: Any) -> bool:
    return (
        isinstance(value, Future | concurrent.futures.Future | CFuture)
        or asyncio.isfuture(value)
        or asyncio.iscoroutine(value)
    )


# How long after its deadline a running ``async def`` is cancelled (see _run_coroutine).
CANCEL_GRACE_S = 0.05


class ServedRequest:
    """One request this worker serves, from its arrival until its reply is written.

    Attributes:
        conn: the connection it came on (its reply goes back there).
        peer: the caller's rank.
        remote: a ``remote()`` request: its value stays here, no reply frame is built.
        runner: what runs it, while it runs as a task or a pool job (None: inline, or not
            started yet); the caller's Cancel cancels it.
        incoming: its view in the call pipeline, until the reply is built (None: no hook
            serves it, or it was cancelled).
        bound: whether losing ``conn`` cancels it (a call started as a task or pool job;
            a remote() request runs on: its value must still land here).
        deadline: when its caller gives up (monotonic; None: never). A request that has
            not started by then never runs, an ``async def`` still running then is
            cancelled, and the function's own calls inherit what is left of it.
    """

    __slots__ = (
        "bound", "conn", "deadline", "incoming", "key", "peer", "remote", "request", "runner",
    )  # fmt: skip

    def __init__(self, conn: Caller, request: Request, peer: int) -> None:
        self.conn, self.request, self.peer = conn, request, peer
        self.key = (peer, request.call_id)
        self.remote = request.mode == CallMode.REMOTE
        # The caller's timeout as a deadline on this clock, from the request's arrival.
        self.deadline = deadline_after(request.timeout)
        self.runner: Runner | None = None
        self.incoming: IncomingCall | None = None
        self.bound = False
