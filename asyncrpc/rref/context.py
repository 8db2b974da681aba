"""The RRef feature of one worker: the operations that make calls, ``remote()`` first, and
the refcount frames routed to the fork bookkeeping (layer L3).

The agent builds it after its outbox, from the ``Calls`` and ``Loop`` ports and the fork
bookkeeping it built first (``forks.py``), so nothing here is two-phase: the RRef cycle
(pickling RRefs needs the bookkeeping; ``remote()`` and ``to_here`` need the calls) is
broken by building the bookkeeping before the calls, and these operations after. RRef
handles reach this feature through its ``FeatureSlot`` (``handle.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from asyncrpc.errors import PeerLostError
from asyncrpc.protocol.refmessages import ForkId, RRefId
from asyncrpc.protocol.wire import Frame
from asyncrpc.protocol.wire.messages import Kind, RefMessage, decode_message
from asyncrpc.rref.forks import Forks
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.calls.pending import describe_function
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.group.events import PeerWatchers
from asyncrpc.runtime.ports import Calls, Loop

__all__ = ["RRefs"]


class RRefs(Feature):
    """RRefs of one worker, as a feature.

    Args:
        forks: the worker's fork bookkeeping (the handles' state, owner values).
        calls: the calls ``remote()``, ``to_here`` and the proxies make.
        loop: the agent's loop (``remote()``'s confirmation deadline runs there).
    """

    name = "rrefs"
    kinds = frozenset({Kind.REF})

    def __init__(self, forks: Forks, calls: Calls, loop: Loop) -> None:
        self.forks = forks
        self._calls = calls
        self._loop = loop
        self._owners = PeerWatchers()  # RRef.on_owner_lost

    def watch_owner(
        self, owner: int, callback: Callable[[PeerLostError], None]
    ) -> Callable[[], None]:
        """``callback(error)`` once when ``owner`` is gone for good (see
        ``RRef.on_owner_lost``)."""
        return self._owners.watch_peer(owner, callback)

    # -- operations ------------------------------------------------------------------------

    def remote(
        self, to: Any, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None = None,
    ) -> RRef[Any]:  # fmt: skip
        """Start ``fn(*args, **kwargs)`` on ``to``, keeping the result there; see ``remote``."""
        calls, forks = self._calls, self.forks
        rank = calls.resolve(to)
        timeout = calls.effective_timeout(timeout)
        if rank == forks.rank:
            return self._remote_to_self(fn, args, kwargs, timeout, target)
        made: list[tuple[RRefId, ForkId]] = []

        def register() -> tuple[RRefId, ForkId]:
            # Called once the payload is pickled: an unpicklable argument must leave no
            # reference state behind. The outbox follows the fork with the request.
            made.append(forks.new_user(rank))
            return made[0]

        observed = calls.send_remote(rank, fn, args, kwargs, timeout, register, target)
        rref_id, fork_id = made[0]
        rref = forks.user(rref_id, fork_id, rank)
        rref._made_by = observed
        if timeout > 0:
            name = target or describe_function(fn)
            check = forks.check_confirmed
            self._loop.run_on_loop(
                self._loop.aio.call_later, timeout, check, fork_id, rank, name, timeout
            )
        return rref

    def _remote_to_self(
        self, fn: Any, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
        target: str | None,
    ) -> RRef[Any]:  # fmt: skip
        # torch's rule: the arguments cross the loopback pickled, as to any worker, but the
        # result becomes the owner's value where it is made, never pickled (it may be a
        # lock, an optimizer, a stream). The request goes as a remote() without a fork, so
        # the dispatcher hands the value to on_value like any owner's.
        forks = self.forks
        made: list[tuple[RRefId, Future[Any]]] = []

        def register() -> tuple[RRefId, None]:
            made.append(forks.new_owner())
            return made[0][0], None

        observed = self._calls.send_remote(forks.rank, fn, args, kwargs, timeout, register, target)
        rref_id, value = made[0]
        rref = forks.owner(rref_id, value)
        rref._made_by = observed
        return rref

    def call(
        self, to: int, fn: Any, args: Sequence[Any], timeout: float, kind: CallKind, target: str
    ) -> Future[Any]:
        """A call made on behalf of an RRef (to_here, proxies), named for the hooks."""
        return self._calls.call_future(to, fn, args, {}, timeout, kind, target)

    def call_sync(self, to: int, fn: Any, args: Sequence[Any], timeout: float, target: str) -> Any:
        """A synchronous call made on behalf of an RRef (a thread's lane may carry it)."""
        return self._calls.call_sync(to, fn, args, {}, timeout, target)

    def off_loop(self) -> bool:
        """Whether the calling thread may block (it is not the agent's loop thread)."""
        return not self._loop.on_loop_thread()

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any:
        return await self._loop.run_in_pool(fn)

    # -- as a feature ----------------------------------------------------------------------

    def on_frame(self, conn: Any, frame: Frame) -> None:
        message = decode_message(frame.fields)  # RemoteProtocolError: the agent aborts
        assert isinstance(message, RefMessage)
        assert conn.peer is not None
        self.forks.on_message(conn.peer, message)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        self.forks.on_peer_lost(rank)
        self._owners.on_gone(rank, error, left=error.evidence == "goodbye")

    def debug_info(self) -> dict[str, Any]:
        return self.forks.debug_info()

    def close(self) -> None:
        self.forks.close()
        self._owners.close()
