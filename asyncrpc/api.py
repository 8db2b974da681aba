"""Module-level API with torch.distributed.rpc's names, plus the asyncio-native ones (L4).

Two ways to run one agent: ``init_rpc`` (synchronous programs: the agent gets its own loop
in a background thread) and ``await init_rpc_async`` (asyncio programs: the agent runs on
the caller's loop, no extra thread). ``await call(...)`` works from any running loop.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar, overload

from asyncrpc.autograd.engine import HOP_CALL
from asyncrpc.autograd.feature import DistAutograd
from asyncrpc.errors import (
    BlockingCallError,
    InitArgumentError,
    InitError,
    NotServingError,
    PeerLostError,
)
from asyncrpc.functions import not_scriptable
from asyncrpc.metrics.snapshot import get_debug_info, get_metrics
from asyncrpc.observe.features import features as observing_features
from asyncrpc.profiling.feature import Profiling
from asyncrpc.protocol.options import (
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    WorkerInfo,
    check_worker_name,
    coerce_options,
)
from asyncrpc.rref.context import RRefs
from asyncrpc.rref.forks import Forks
from asyncrpc.rref.handle import RRef, current_rrefs
from asyncrpc.runtime.agent import Agent
from asyncrpc.runtime.calls.deadline import serving_peer
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.current import clear_agent, current_agent, set_agent
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.group.events import MemberEvents
from asyncrpc.runtime.group.join import Group
from asyncrpc.runtime.group.shutdown import shutdown_limit
from asyncrpc.runtime.ports import Frames, Loop, Ports
from asyncrpc.runtime.threads.loopthread import LoopThread

__all__ = [
    "BackendType",
    "call",
    "get_debug_info",
    "get_metrics",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "init_rpc_async",
    "is_available",
    "membership",
    "on_caller_lost",
    "on_peer_lost",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "shutdown_async",
    "worker",
]

P = ParamSpec("P")
R = TypeVar("R")

_log = logging.getLogger(__name__)
# The loop thread of an agent started by init_rpc (None for init_rpc_async agents).
_loop_threads: dict[int, LoopThread] = {}
_lifecycle_lock = threading.Lock()
_exit_check = threading.Event()  # set once the check at exit is registered


class BackendType(enum.Enum):
    """torch's ``rpc.BackendType``, for ``init_rpc(..., backend=rpc.BackendType.TENSORPIPE)``
    lines. asyncrpc has one backend, its own agent; ``TENSORPIPE`` (torch's default and
    only public backend) selects it, as torch's member does."""

    TENSORPIPE = "TENSORPIPE"


def is_available() -> bool:
    """Whether RPC can be used in this build (torch's ``rpc.is_available``).

    Returns:
        True, always: asyncrpc needs no distributed build of torch (torch's is False in
        builds without distributed support).
    """
    return True


def _check_name(name: str, backend: object) -> None:
    check_worker_name(name)
    if backend is None:
        return
    if type(backend).__name__ != "BackendType":  # torch's enum; a plain string is refused
        raise InitArgumentError(
            f"Argument backend must be a member of BackendType (torch's "
            f"BackendType.TENSORPIPE) or None, got {type(backend).__name__}"
        )
    if "TENSORPIPE" not in str(backend).upper():
        raise InitError(f"unsupported backend {backend!r}: asyncrpc has one backend")


def init_rpc(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
) -> None:
    """Start this process's worker on a background event loop (torch's ``init_rpc``).

    Args:
        name: a name unique in the group.
        backend: None, or torch's ``BackendType.TENSORPIPE`` (accepted for drop-in use).
        rank: this worker's rank; -1 reads ``RANK`` with ``env://``.
        world_size: number of workers. None joins a dynamic group: members join (and
            leave) at any time and find each other in the rendezvous store; with
            ``env://`` and ``WORLD_SIZE`` set, that size is read instead (a static group).
        rpc_backend_options: ``asyncrpc.RpcBackendOptions`` or torch's
            ``TensorPipeRpcBackendOptions``.

    Raises:
        MissingRankError: no rank, and the init method has none (a ``ValueError``).
        MixedGroupError: the group mixes static and dynamic members.
        InitError: bad arguments, duplicate name or rank, rendezvous failure, or a worker
            already running in this process.
    """
    _check_name(name, backend)
    options = coerce_options(rpc_backend_options, backend)
    with _lifecycle_lock:
        current = _peek_agent()
        if current is not None:
            raise InitError(f"RPC is already initialized: this process runs {current.group.name!r}")
        thread = LoopThread(name=f"asyncrpc-{name}")
        try:
            agent = thread.run(_start(name, rank, world_size, options))
        except BaseException:
            thread.stop()
            raise
        _loop_threads[id(agent)] = thread


async def init_rpc_async(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
) -> None:
    """Start this process's worker on the running event loop (no extra thread).

    The agent then runs on this loop: keep the loop running (``await`` your work on it)
    until ``shutdown_async``. Cancelling it abandons the start and closes what was opened.

    Args:
        name: a name unique in the group.
        backend: None, or torch's ``BackendType.TENSORPIPE``.
        rank: this worker's rank; -1 reads ``RANK`` with ``env://``.
        world_size: number of workers; None joins a dynamic group (see ``init_rpc``).
        rpc_backend_options: ``asyncrpc.RpcBackendOptions`` or torch's
            ``TensorPipeRpcBackendOptions``.

    Raises:
        MissingRankError: no rank, and the init method has none (a ``ValueError``).
        MixedGroupError: the group mixes static and dynamic members.
        InitError: as for ``init_rpc``.
    """
    _check_name(name, backend)
    options = coerce_options(rpc_backend_options, backend)
    if _peek_agent() is not None:
        raise InitError(
            f"RPC is already initialized: this process runs {current_agent().group.name!r}"
        )
    await _start(name, rank, world_size, options)


def _forks(group: Group, options: RpcBackendOptions, loop: Loop, frames: Frames) -> Forks:
    # The RRef layer's fork bookkeeping: the agent builds it before anything that pickles.
    worker_info = group.directory.worker_info
    return Forks(group.rank, group.name, loop, frames, worker_info, options.rref_leaks)


def _features(ports: Ports, forks: Forks) -> list[Feature]:
    # The features of the floors above the runtime, once the agent's calls exist (profiling
    # before autograd: its span covers the other hooks' work).
    # Then the observers (asyncrpc/observe/), idle until asked: their hooks see the others'.
    return [
        RRefs(forks, ports.calls, ports.loop), Profiling(ports), DistAutograd(ports, (HOP_CALL,)),
        *observing_features(),
    ]  # fmt: skip


async def _start(name: str, rank: int, world_size: int | None, options: RpcBackendOptions) -> Agent:
    # The runtime's agent, with this package's features plugged in (the agent itself is the
    # composition root: it builds its parts and these in order).
    agent = await Agent.start(
        name, rank, world_size, options, _forks, _features, register=set_agent
    )
    if not _exit_check.is_set():
        _exit_check.set()
        # Registered after logging's own exit handler (atexit runs the last first), so the
        # warning is still written.
        atexit.register(_warn_if_running)
    return agent


def _warn_if_running() -> None:
    """At exit: a worker still running was never shut down. Its peers will see it vanish
    (a reset, or nothing until a timeout), so say here what was forgotten."""
    agent = _peek_agent()
    if agent is None or agent.closed:
        return
    # A plain flag, read on the loop thread only to choose what to log: peers that go
    # away now are not followed by "the next call reconnects".
    agent.network.leaving = True
    _log.warning(
        "asyncrpc worker %r was not shut down; call asyncrpc.shutdown() before the program "
        "ends (rpc.shutdown() in torch's words): its peers see it vanish, their calls to it "
        "fail and their own shutdown() waits for it or fails",
        agent.group.name,
    )


def _peek_agent() -> Agent | None:
    try:
        return current_agent()
    except Exception:
        return None


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop this process's worker (torch's ``shutdown``), blocking until it is done.

    With ``graceful``, every worker first finishes its outstanding work and waits for all
    the others, serving their calls meanwhile: as in torch, a worker may call
    ``shutdown()`` right after ``init_rpc`` and serve until everybody is done. The wait has
    no limit unless ``timeout`` (or ``RpcBackendOptions.shutdown_timeout`` when
    ``timeout`` is None) gives one; 0 means no limit too. Workers that died during the job
    are not waited for: the survivors finish together, and the dead are reported as
    ``RpcBackendOptions.lost_workers`` says (a warning by default). ``graceful=False``
    stops only this worker.

    Args:
        graceful: wait for the whole group (True) or stop only this worker.
        timeout: seconds the graceful part may take; None: the option's; 0: no limit.

    Raises:
        ShutdownTimeoutError: the bound ran out (a ``ShutdownError`` and a ``TimeoutError``).
        WorkersLostError: workers died and ``lost_workers="error"`` was asked for.
        ShutdownError: the rendezvous store is gone (its host, rank 0, died).
            After any of these this worker is stopped all the same.
        ValueError: ``timeout`` is negative (nothing is stopped).
        BlockingCallError: called on the agent's own loop thread (use ``shutdown_async``).
    """
    shutdown_limit(timeout)  # a bad timeout is refused before anything stops
    agent = current_agent()
    if agent.loop.on_loop_thread():
        raise BlockingCallError("shutdown() would block the agent's loop; use shutdown_async()")
    thread = _loop_threads.pop(id(agent), None)
    try:
        asyncio.run_coroutine_threadsafe(agent.shutdown(graceful, timeout), agent.loop.aio).result()
    finally:
        clear_agent(agent)
        if thread is not None:
            thread.stop()


async def shutdown_async(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop this process's worker from async code; see ``shutdown``.

    Cancelling it leaves the worker stopping in the background.
    """
    shutdown_limit(timeout)  # a bad timeout is refused before anything stops
    agent = current_agent()
    thread = _loop_threads.pop(id(agent), None)
    try:
        if asyncio.get_running_loop() is agent.loop.aio:
            await agent.shutdown(graceful, timeout)
        else:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(agent.shutdown(graceful, timeout), agent.loop.aio)
            )
    finally:
        clear_agent(agent)
        if thread is not None:
            await asyncio.to_thread(thread.stop)


@asynccontextmanager
async def worker(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
    *,
    graceful: bool = True,
) -> AsyncIterator[WorkerInfo]:
    """``async with asyncrpc.worker(...)``: ``init_rpc_async`` on entry, shutdown on exit.

    Exits with a graceful shutdown unless the block raised (then only this worker stops).
    Cancelling the task inside the block leaves it as an exception does.

    Args:
        name, backend, rank, world_size, rpc_backend_options: as for ``init_rpc``.
        graceful: False stops only this worker on exit, without waiting for the others.

    Yields:
        This worker's ``WorkerInfo``.

    Raises:
        The errors of ``init_rpc`` on entry and of ``shutdown`` on exit.
    """
    await init_rpc_async(name, backend, rank, world_size, rpc_backend_options)
    agent = current_agent()
    ok = False
    try:
        yield agent.outbox.worker_info(agent.group.rank)
        ok = True
    finally:
        await shutdown_async(graceful=graceful and ok)


@overload
async def call(
    to: Any, func: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
) -> R: ...


@overload
async def call(to: Any, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R: ...


async def call(to: Any, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    The asyncio-native call; works from any running loop of the process. The default
    ``rpc_timeout`` applies; for a per-call limit wrap it in ``asyncio.timeout(...)``:
    cancelling the awaiting task (which ``asyncio.timeout`` does) cancels the remote work
    too (an ``async def`` function is cancelled; a pool job not yet started is dropped).

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        func: a module-level function, ``async def`` function, builtin torch op,
            TorchScript function, static or class method.
        *args: positional arguments, pickled (tensors travel as raw buffers).
        **kwargs: keyword arguments, all passed to ``func``.

    Returns:
        The function's result.

    Raises:
        Exception: the exception ``func`` raised, as its original type (and a
            ``RuntimeError`` too: see ``RemoteCallError``); ``RemoteError`` when it cannot
            be rebuilt here.
        RpcTimeoutError: no reply within the default ``rpc_timeout``.
        UnknownWorkerError: ``to`` names no worker of the group.
        SerializationError: an argument cannot be pickled (raised before sending).
        FunctionNotFoundError: the callee cannot import ``func``.
        PeerLostError: the callee died or its connection dropped with the call on it.
        NotInitializedError: no worker runs in this process.
    """
    calls = current_agent().outbox
    if asyncio.get_running_loop() is calls.loop:
        return await calls.call(to, func, args, kwargs, UNSET_RPC_TIMEOUT)
    future = calls.call_future(to, func, args, kwargs, UNSET_RPC_TIMEOUT)
    try:
        value = await future
    except asyncio.CancelledError:
        future.cancel()
        raise
    return value


@not_scriptable
def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[Any]:
    """Start ``func(*args, **kwargs)`` on ``to`` and return an ``asyncrpc.Future`` (torch's).

    ``Future.cancel()`` cancels the remote work (an ``async def`` is cancelled on the
    callee; a pool job not yet started is dropped).

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        func: what ``call`` takes (a module-level function, ``async def``, builtin op...).
        args: positional arguments (a tuple or list), pickled.
        kwargs: keyword arguments.
        timeout: seconds; -1 means the default ``rpc_timeout``, 0 (or ``inf``) none.

    Returns:
        A ``Future`` of the result: ``wait()`` it, ``await`` it, or chain ``then``. It
        fails with the errors of ``call`` (the remote exception as its type,
        ``RpcTimeoutError``, ``PeerLostError``...).

    Raises:
        UnknownWorkerError: ``to`` names no worker (at once, not through the future).
        SerializationError: an argument cannot be pickled (at once).
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().outbox.call_future(
        to, func, tuple(args or ()), dict(kwargs or {}), timeout, CallKind.ASYNC
    )


@not_scriptable
def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and block for the result (torch's ``rpc_sync``).

    Args:
        to: a worker name, rank or ``WorkerInfo``.
        func: what ``call`` takes (a module-level function, ``async def``, builtin op...).
        args: positional arguments (a tuple or list), pickled.
        kwargs: keyword arguments.
        timeout: seconds; -1 means the default ``rpc_timeout``, 0 (or ``inf``) none.

    Returns:
        The function's result.

    Raises:
        BlockingCallError: called on the agent's loop thread (use ``await call``).
        Exception: the remote exception as its original type, and the errors of ``call``.
    """
    agent = current_agent()
    if threading.get_ident() == agent.loop.thread_id:
        raise BlockingCallError(
            "rpc_sync() would block the agent's event loop; use `await asyncrpc.call(...)`"
        )
    return agent.outbox.call_sync(to, func, tuple(args or ()), dict(kwargs or {}), timeout)


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """``WorkerInfo`` of ``worker_name`` (a name or rank), or of this worker when None.

    Args:
        worker_name: a worker's name or rank; None for this worker.

    Returns:
        Its ``WorkerInfo`` (``name`` and rank ``id``).

    Raises:
        UnknownWorkerError: no such worker.
        NotInitializedError: no worker runs in this process.
    """
    agent = current_agent()
    calls = agent.outbox
    rank = agent.group.rank if worker_name is None else calls.resolve(worker_name)
    return calls.worker_info(rank)


def get_worker_infos() -> list[WorkerInfo]:
    """``WorkerInfo`` of every worker in the group, by rank.

    In a dynamic group: the members in the group now, read in the rendezvous store; called
    on the agent's loop thread (it must not block there), the members this worker knows.

    Returns:
        A list of ``WorkerInfo``, this worker's included, sorted by rank.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().worker_infos()


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds (``RpcBackendOptions.rpc_timeout``).

    Returns:
        Seconds; 0 means calls have no default limit.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().options.rpc_timeout


def on_peer_lost(callback: Callable[[PeerLostError], None]) -> Callable[[], None]:
    """Call ``callback(error)`` once for each worker of the group lost for good from now
    on: it died, or went silent past ``heartbeat_timeout``, or refused to be redialled.
    ``error`` is the ``PeerLostError`` its pending calls failed with (``error.worker``
    names it, ``error.reason`` says why). A worker that left by shutting down is no loss.

    The callback runs on the callback pool, where it may block or make calls (to the
    other workers: the lost one's calls fail at once); one that raises is logged. It
    starts when the loss is declared, after the worker's own bookkeeping (the lost
    worker's calls failed, its RRefs forgotten).

    Returns:
        A function that stops the callback.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().watchers.watch_all(callback)


def on_caller_lost(callback: Callable[[PeerLostError], None]) -> Callable[[], None]:
    """Inside a function served for a peer: call ``callback(error)`` once when that peer
    (the caller) is gone for good, so that this worker can release what it keeps for it (a
    parameter server's per-trainer state, say). Gone means lost (it died, hung or became
    unreachable: ``error.evidence`` is ``"silence"`` or ``"redial_refused"``) or left (it
    shut down: ``"goodbye"``). Registered once per caller is enough; a callback registered
    for a peer already gone runs at once. It runs on the callback pool, where it may block
    or make calls.

    Returns:
        A function that stops the callback.

    Raises:
        NotServingError: not called from inside a function served for a peer.
    """
    caller = serving_peer()
    if caller is None:
        raise NotServingError(
            "on_caller_lost() needs a caller: call it inside a function a peer called"
        )
    return current_agent().watchers.watch_peer(caller, callback)


def membership() -> MemberEvents:
    """An async iterator of the group's changes from now on, as this worker sees them:
    ``MemberEvent`` s of kind ``"joined"`` (a member that joined a dynamic group after this
    worker, once this worker meets it: its first call here, or a look-up), ``"left"`` (it
    shut down) and ``"lost"`` (it died, hung or became unreachable, with the evidence).

    ``async for event in asyncrpc.membership(): ...`` on any event loop (the worker's own,
    inside an ``async def`` it serves, or the program's). The iteration ends when the
    iterator is closed (``close()``, or leaving ``async with``) or this worker shuts down.
    ``get_worker_infos()`` gives the members at any moment.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().watchers.subscribe()


@not_scriptable
def remote(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an ``RRef`` to the result there.

    Returns at once; the owner confirms the reference in the background. Errors raised
    while creating the value surface on ``to_here()`` and proxy calls, as their original
    type. If the owner does not confirm within ``timeout``, the RRef becomes unusable and
    its next use raises ``RRefTimeoutError``.

    Args:
        to: the worker that runs ``func`` and owns the result (a name, rank or
            ``WorkerInfo``); this worker's own name keeps the value unpickled.
        func: what ``call`` takes (a module-level function, ``async def``, builtin op...).
        args: positional arguments (a tuple or list), pickled.
        kwargs: keyword arguments.
        timeout: seconds; -1 means the default ``rpc_timeout``, 0 (or ``inf``) none.

    Returns:
        A user ``RRef`` to the value on ``to`` (the owner ``RRef`` when ``to`` is this
        worker).

    Raises:
        UnknownWorkerError: ``to`` names no worker (at once).
        SerializationError: an argument cannot be pickled (at once).
        NotInitializedError: no worker runs in this process.
    """
    return current_rrefs().remote(to, func, tuple(args or ()), dict(kwargs or {}), timeout)
