"""The narrow ports the runtime's parts and the features above it are built from (layer
L2.03).

A part takes the few things it uses, by name, never the agent (httpcore's
``create_connection`` hands a connection its origin and stream, never its pool):

- ``Loop``: the agent's event loop, its thread, hand-offs to it, and the worker pool;
- ``Frames``: writing frames (``OutgoingFrame``, one record for what every frame carries),
  bookkeeping frames, refcount frames, liveness (the ``Network`` implements it);
- ``Calls``: making calls, from any thread (the ``Outbox`` implements it);
- ``ForkLedger``: the RRef layer's fork bookkeeping as the runtime uses it, built before
  everything that pickles (``asyncrpc/rref/forks.py`` implements it).

``Ports`` bundles them for the features the agent builds last.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.options import RpcBackendOptions, WorkerInfo
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.protocol.wire.messages import Request
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.threads.loopinbox import LoopInbox
from asyncrpc.runtime.threads.pool import WorkerPool

__all__ = [
    "CallKind",
    "Calls",
    "ForkLedger",
    "Frames",
    "Loop",
    "Members",
    "OutgoingFrame",
    "Ports",
    "Register",
    "SentCall",
]

# For remote(): makes the RRef id and the caller's fork id once the payload is pickled.
Register = Callable[[], tuple[tuple[int, int], tuple[int, int] | None]]


class CallKind(enum.StrEnum):
    """How a call was made, as the hooks see it: torch's exec modes (``RPCExecMode``), and
    a stream. Its value is torch's word, as profiles name spans (``rpc_sync#...``)."""

    SYNC = "sync"  # rpc_sync, to_here, RRef.rpc_sync() proxies: the caller blocks
    ASYNC = "async"  # rpc_async, await call, RRef.rpc_async() proxies
    REMOTE = "remote"  # remote(), RRef.remote() proxies: the value stays on the callee
    STREAM = "stream"  # stream(), rpc_stream(): items flow until the generator ends


class Loop:
    """The agent's event loop as its parts use it: the loop (``aio``), the thread it runs
    on, hand-offs to it from other threads, and the pool for synchronous work.

    Built on the loop's thread, first of all the parts.
    """

    __slots__ = ("_inbox", "aio", "pool", "thread_id")

    def __init__(self, aio: asyncio.AbstractEventLoop, pool: WorkerPool) -> None:
        self.aio = aio
        self.pool = pool
        self.thread_id = threading.get_ident()
        self._inbox = LoopInbox(aio, "thread_to_loop")

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    def run_on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now if this is the loop's thread, else in order
        with what other threads hand over, one loop wake-up per batch."""
        if threading.get_ident() == self.thread_id:
            fn(*args)
        else:
            self._inbox.put(fn, args)

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on a pool thread (from the loop); its result or exception."""
        return await self.pool.run(fn)


class SentCall(Protocol):
    """The call a request frame belongs to, as the network asks about it."""

    @property
    def call_id(self) -> int: ...

    def wanted(self) -> bool:
        """Whether the call still waits for its reply (not timed out or cancelled)."""

    def written(self, conn: object) -> None:
        """Its request went out on ``conn``: losing that connection fails the call."""

    def unsent(self, exc: BaseException) -> bool:
        """Its request could not be written: fail the call; False if it had ended."""


class OutgoingFrame(NamedTuple):
    """One frame for a peer (a named tuple: made once per call, cheaply).

    Attributes:
        rank: the peer it goes to (this worker's own rank: the loopback).
        pieces: the frame, as ``encode_frame`` returns it.
        keep: what keeps the memory of its zero-copy pieces valid until written.
        forks: the RRef forks it carries, followed until the peer has read it (None: none).
        call: the call it is the request of; a failure to write it fails the call, and it
            is skipped once the call is over (None: no call).
        ready: what it must wait for before it is written (GPU work still filling its
            bytes); frames to the same peer behind it wait too (None: nothing).
    """

    rank: int
    pieces: list[Any]
    keep: object = None
    forks: list[ForkPair] | None = None
    call: SentCall | None = None
    ready: Awaitable[None] | None = None


class Frames(Protocol):
    """How parts write frames, on the loop thread (``asyncrpc.runtime.net.Network``)."""

    def send(self, frame: OutgoingFrame) -> None:
        """Write ``frame`` to its peer in order, once it is ready and connected."""

    def write(
        self, conn: Any, pieces: list[Any], keep: object = None,
        forks: list[ForkPair] | None = None,
    ) -> None:  # fmt: skip
        """Write a frame on ``conn`` (a reply goes where its request came from)."""

    def control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        """Write a bookkeeping frame to ``rank`` if it is connected (to this worker: the
        loopback), or connecting first when ``connect``; else it is dropped."""

    def send_ref(self, rank: int, pieces: list[Any]) -> None:
        """Send a refcount frame, again on a new connection until acknowledged."""

    def cancel(self, rank: int, call_id: int) -> None:
        """Tell ``rank`` that ``call_id`` is over (if its request was written)."""

    def is_lost(self, rank: int) -> bool:
        """Whether ``rank`` is gone for good."""


class Calls(Protocol):
    """How parts and features make calls, from any thread (``Outbox``)."""

    @property
    def closed(self) -> bool: ...

    def resolve(self, to: Any) -> int:
        """The rank of ``to`` (a name, rank or ``WorkerInfo``)."""

    def worker_info(self, rank: int) -> WorkerInfo: ...

    def effective_timeout(self, timeout: float) -> float:
        """torch's rule: negative means the default, 0 (or inf) none."""

    def call_future(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        kind: CallKind = ..., target: str | None = ...,
    ) -> Future[Any]: ...  # fmt: skip

    async def call(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any: ...

    def call_sync(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None = ...,
    ) -> Any: ...  # fmt: skip

    def call_on_lane(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        """``call_sync`` on this thread's lane to ``to``; ``Outbox``'s ``NOT_ON_LANE``
        where the thread has none (nothing was sent)."""

    def call_coded_on_lane(self, to: Any, coded: CodedCall, args: Any, timeout: float) -> Any:
        """``call_on_lane`` for a call with its own wire format (``protocol/coded.py``)."""

    def start_sync(
        self, to: Any, fn: Any, args: Sequence[Any], timeout: float, loop_fn: Any = None
    ) -> Any:
        """Start a call a thread will wait for (``finish_sync``), on its lane if it may."""

    def finish_sync(self, started: Any) -> Any:
        """The reply of a call ``start_sync`` started: its value, or its error raised."""

    def send_remote(
        self, rank: int, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        register: Register, target: str | None = ...,
    ) -> Future[Any] | None: ...  # fmt: skip


class ForkLedger(Protocol):
    """The RRef layer's fork bookkeeping, as the runtime's parts use it (built before them).

    RRefs pickled into a frame become forks (``dump``, which appends them to the message's
    ``made`` list, see ``Serializer.dumps``); the frame carries them and the network
    follows them until the peer has read it, or gives them back (``undelivered``), or
    asks about them (``query_forks``).
    """

    # -- the serializer's hooks (any thread) --
    def dump(self, obj: object, dest: object, made: list[Any]) -> tuple[Any, ...] | None: ...

    def load(self, pid: tuple[Any, ...], sender: object) -> object: ...

    def undelivered(self, rank: int, forks: list[ForkPair]) -> None: ...

    def query_forks(self, rank: int, forks: list[ForkPair]) -> None: ...

    def on_lane_ack(self, peer: int, forks: list[ForkPair]) -> None: ...

    # -- remote() requests this worker owns the values of (the dispatcher, on the loop) --
    def on_remote_request(self, peer: int, request: Request) -> None: ...

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None: ...

    def expire_value(self, request: Request) -> bool: ...

    def take_unconfirmed(self) -> Any: ...

    # -- an owner nobody can find, and the graceful shutdown's rounds --
    def on_peer_lost(self, rank: int) -> None: ...

    def release_all_users(self) -> None: ...

    def quiescent(self) -> bool: ...

    def owner_leaks(self) -> list[Any]: ...

    def report_leaks(self) -> None: ...


class Members(Protocol):
    """Who is in the group, as features read it (``asyncrpc.runtime.group.Group``)."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def addresses(self) -> dict[int, PeerAddress]: ...


class Ports(NamedTuple):
    """What the agent hands the features it builds last, once its calls exist."""

    members: Members
    options: RpcBackendOptions
    loop: Loop
    calls: Calls
    frames: Frames
    counters: Counters
