"""The fork bookkeeping of one worker: owner values, and the refcount state machine
driven from the agent's loop (layer L3).

``RefCounter`` (asyncrpc/protocol/refcount.py) decides; ``Forks`` carries out its actions:
sends refcount messages (through the ``Frames`` port), frees owner values, fails
references whose owner is gone. It is the serializer's RRef hooks (an RRef pickled into a
frame becomes a fork, returned with the payload), so the agent builds it before anything
that pickles, from the group, the loop and the network; the RRef operations that make
calls (``remote()``, ``to_here``: ``context.py``) come after the outbox. RRefs are pickled
on whatever thread makes a call, so every use of the state machine holds one lock (its
methods are short and pure); its actions are then applied on the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any

from asyncrpc.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    RRefError,
    RRefOwnerLostError,
    RRefTimeoutError,
    ShutdownError,
    as_remote_call_error,
)
from asyncrpc.errorstate import own_copy
from asyncrpc.protocol.options import WorkerInfo
from asyncrpc.protocol.refcount import RefCounter, UserState
from asyncrpc.protocol.reflog import ForkPair
from asyncrpc.protocol.refmessages import (
    Action,
    ChildAccepted,
    ForkAccepted,
    ForkId,
    ForkQuery,
    ForkRequest,
    ForkUnknown,
    Free,
    RemoteUndelivered,
    RRefId,
    RRefLost,
    Send,
    UserDelete,
)
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import RefMessage, RefOp, Request
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.futures import Future, collect_all, try_set_result
from asyncrpc.runtime.ports import Frames, Loop
from asyncrpc.runtime.threads import handoffs

__all__ = ["Forks"]

_log = logging.getLogger(__name__)
_TAG = "asyncrpc.rref"
_HOME_TAG = "asyncrpc.rref.home"  # a user's RRef pickled for its owner: no fork

_TO_WIRE = {ForkRequest: RefOp.FORK_REQUEST, ForkAccepted: RefOp.FORK_ACCEPTED,
            ChildAccepted: RefOp.CHILD_ACCEPTED, UserDelete: RefOp.USER_DELETE,
            ForkQuery: RefOp.FORK_QUERY, ForkUnknown: RefOp.FORK_UNKNOWN}  # fmt: skip
_FROM_WIRE: dict[int, Any] = {op: cls for cls, op in _TO_WIRE.items()}


# Forks unpickled outside requests (in replies) pile up in RRefContext._loaded until the
# next request; past this many, the confirmed ones are dropped.
_LOADED_LIMIT = 256


class Forks:
    """Owner values and reference bookkeeping of one worker (the ``ForkLedger`` port).

    Args:
        rank: this worker's rank.
        name: its name, for errors.
        loop: the agent's loop (actions are carried out there) and its pool.
        frames: sends the refcount messages.
        worker_info: names the members, for errors.
        rref_leaks: what a shutdown with owned values still referenced does ("ignore",
            "warn" or "error").
    """

    def __init__(
        self, rank: int, name: str, loop: Loop, frames: Frames,
        worker_info: Callable[[int], WorkerInfo], rref_leaks: str,
    ) -> None:  # fmt: skip
        self.rank, self.name = rank, name
        self.loop, self._loop = loop.aio, loop
        self._frames, self.worker_info, self._rref_leaks = frames, worker_info, rref_leaks
        self.counter = RefCounter(rank)
        self._lock = threading.Lock()
        self._values: dict[RRefId, Future[Any]] = {}
        self._lost: dict[RRefId, int] = {}
        # User forks made unusable (remote() not confirmed in time, or never delivered).
        self._unusable: dict[ForkId, RRefError] = {}
        self._queried = 0  # ForkQuery messages sent
        # Forks received from a worker other than the owner, until the owner accepts them
        # (by owner rank); `_loaded` lists those of the request being unpickled, so that
        # the dispatcher runs it once they are confirmed, as torch does.
        self._confirming: dict[ForkId, tuple[int, Future[None]]] = {}
        self._loaded: list[Future[None]] = []
        self.closed = False

    # -- creating --------------------------------------------------------------------------

    def create_local(self, value: Any) -> tuple[RRefId, Future[Any]]:
        """``RRef(value)``: register a value held here, with one local owner handle."""
        with self._lock:
            rref_id = self.counter.next_rref_id()
            self.counter.new_owner(rref_id)
        future: Future[Any] = Future(loop=self.loop)
        future.set_result(value)
        self._values[rref_id] = future
        return rref_id, future

    def new_user(self, owner: int) -> tuple[RRefId, ForkId]:
        """``remote()`` to ``owner``: a new RRef id and this worker's user fork of it
        (called once the payload is pickled: an unpicklable argument leaves no state)."""
        with self._lock:
            rref_id = self.counter.next_rref_id()
            fork_id, _ = self.counter.new_user(rref_id, owner)
        return rref_id, fork_id

    def user(self, rref_id: RRefId, fork_id: ForkId, owner: int) -> RRef[Any]:
        """The handle of a user fork this worker made (``remote()``)."""
        return RRef._make(self, rref_id, fork_id, owner, None)

    def new_owner(self) -> tuple[RRefId, Future[Any]]:
        """``remote()`` to this worker: a new RRef id, owned here, and its value's future
        (the arguments cross the loopback pickled; the value is made here, never pickled)."""
        with self._lock:
            rref_id = self.counter.next_rref_id()
            self.counter.new_owner(rref_id)
        value: Future[Any] = Future(loop=self.loop)
        self._values[rref_id] = value
        return rref_id, value

    def owner(self, rref_id: RRefId, value: Future[Any]) -> RRef[Any]:
        """The owner's handle of a value this worker holds."""
        return RRef._make(self, rref_id, None, self.rank, value)

    def check_confirmed(self, fork_id: ForkId, rank: int, target: str, timeout: float) -> None:
        """``remote()``'s timeout passed: a fork its owner has not confirmed is unusable."""
        with self._lock:
            try:
                if self.counter.user_state(fork_id) is not UserState.UNCONFIRMED:
                    return
                actions = self.counter.timeout_user(fork_id)
            except LocalProtocolError:
                return  # released and deleted meanwhile
        self._unusable[fork_id] = RRefTimeoutError(self.worker_info(rank).name, target, timeout)
        self.apply(actions)

    # -- owner side of remote() ------------------------------------------------------------

    def on_remote_request(self, peer: int, request: Request) -> None:
        """A remote() request arrived: register the caller's fork before running it."""
        assert request.rref_id is not None
        rref_id = RRefId(*request.rref_id)
        if request.fork_id is not None:
            fork_id = ForkId(*request.fork_id)
            with self._lock:
                actions = self.counter.new_owner(rref_id, holder=peer, fork_id=fork_id)
            self._values.setdefault(rref_id, Future(loop=self.loop))
            self.apply(actions)
        elif peer != self.rank:
            raise RemoteProtocolError(f"worker {peer} sent a remote() request without a fork")
        # else a remote() to oneself: registered before it was sent (and maybe freed since,
        # if its only handle was dropped: on_value then discards the result)

    def expire_value(self, request: Request) -> bool:
        """The timeout of a remote() request passed (the dispatcher's deadline): its value
        fails with ``RRefTimeoutError`` unless it is made; whether it failed it."""
        assert request.rref_id is not None
        value = self._values.get(RRefId(*request.rref_id))
        if value is None or value.done():
            return False
        value.set_exception(RRefTimeoutError(self.name, request.target, request.timeout))
        return True

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        """The function of a remote() request finished (the dispatcher's value sink)."""
        assert request.rref_id is not None
        future = self._values.get(RRefId(*request.rref_id))
        if future is None or future.done():
            return  # freed already (every user let go), or timed out: discard
        if ok:
            future.set_result(value)
        else:
            # Keep the lines for the remote traceback, drop the locals (the call's
            # arguments, RRefs among them) that would otherwise live as long as the value.
            traceback.clear_frames(value.__traceback__)
            # Fetches raise copies without this traceback (see handle._owner_value): a note
            # keeps where the function failed for every user that fetches the value.
            with contextlib.suppress(Exception):
                lines = "".join(traceback.format_exception(value))
                value.add_note(f"Raised on worker {self.name!r} by {request.target}:\n{lines}")
            # As a caller of the function would get it: also a RuntimeError (torch's type).
            future.set_exception(as_remote_call_error(value))

    def owned_value(self, worker_id: int, local_id: int) -> Future[Any]:
        """The future of a value owned here, by its RRef id (``to_here`` fetches by id);
        made pending if the remote() that creates it is still on its way.

        Raises:
            RRefError: this worker owns no such value (freed, or never created here).
        """
        rref_id = RRefId(worker_id, local_id)
        value = self._values.get(rref_id)
        if value is None:
            with self._lock:
                on_its_way = self.counter.on_its_way(rref_id)
            if not on_its_way:
                raise RRefError(
                    f"worker {self.name!r} owns no RRef {(worker_id, local_id)}: "
                    "it was freed or never created here"
                )
            # Its remote() took another connection (a lane) and is not here yet: the fetch
            # waits for it, as for a value still being made (its timeout bounds that).
            value = self._values.setdefault(rref_id, Future(loop=self.loop))
        return value

    # -- pickling (serializer hooks) -------------------------------------------------------

    def dump(self, obj: object, dest: object, made: list[Any]) -> tuple[Any, ...] | None:
        """Persistent id of an RRef pickled for worker ``dest``: a new fork of it, appended
        to ``made`` (the serializer returns it with the payload: the frame carrying it is
        followed until ``dest`` has read it, see reflog.py)."""
        if not isinstance(obj, RRef):
            return None
        if obj._ctx is not self:
            raise RRefError("this RRef belongs to an agent that has shut down")
        if not isinstance(dest, int):
            raise RRefError("RRefs can only be pickled as part of an RPC")
        with self._lock:
            if obj._fork_id is None:
                fork_id = self.counter.fork_from_owner(obj._rref_id, dest)
            elif dest == obj._owner:
                self.counter.send_home(obj._rref_id, obj._fork_id)
                return (_HOME_TAG, *obj._rref_id)
            else:
                fork_id = self.counter.fork_from_user(obj._rref_id, obj._fork_id, dest)
        if dest != self.rank:
            made.append((obj._rref_id, fork_id))
        return (_TAG, *obj._rref_id, *fork_id, obj._owner, self.rank)

    def undelivered(self, rank: int, forks: list[ForkPair]) -> None:
        """The frame carrying ``forks`` to ``rank`` was never written: undo them."""
        actions: list[Action] = []
        with self._lock:
            for rref_id, fork_id in forks:
                actions += self.counter.undelivered(rank, RRefId(*rref_id), ForkId(*fork_id))
        self.apply(actions)

    def query_forks(self, rank: int, forks: list[ForkPair]) -> None:
        """Ask ``rank`` whether the frames carrying ``forks``, written on a connection that
        died, arrived (it answers ForkUnknown for those that did not)."""
        self._queried += len(forks)
        self.apply([Send(rank, ForkQuery(RRefId(*r), ForkId(*f))) for r, f in forks])

    def load(self, pid: tuple[Any, ...], sender: object) -> RRef[Any]:
        """The RRef a ``dump`` tuple stands for, unpickled here."""
        me = self.rank
        if pid[0] == _HOME_TAG:
            _tag, rw, rl = pid
            rref_id = RRefId(rw, rl)
            with self._lock:
                actions = self.counter.returned_home(rref_id)
            self.apply(actions)
            value = self._values.setdefault(rref_id, Future(loop=self.loop))
            return RRef._make(self, rref_id, None, me, value)
        _tag, rw, rl, fw, fl, owner, parent = pid
        rref_id, fork_id = RRefId(rw, rl), ForkId(fw, fl)
        with self._lock:
            if owner == me:
                actions = self.counter.received_own(rref_id, fork_id, parent)
            else:
                actions = self.counter.received_user(rref_id, fork_id, owner, parent)
                if parent != owner and fork_id not in self._confirming:
                    confirming: Future[None] = Future(loop=self.loop)
                    self._confirming[fork_id] = (owner, confirming)
                    if len(self._loaded) >= _LOADED_LIMIT:  # no request took them: replies
                        self._loaded = [f for f in self._loaded if not f.done()]
                    self._loaded.append(confirming)
        self.apply(actions)
        if owner == me:
            value = self._values.setdefault(rref_id, Future(loop=self.loop))
            return RRef._make(self, rref_id, None, me, value)
        return RRef._make(self, rref_id, fork_id, owner, None)

    # -- releasing -------------------------------------------------------------------------

    def release(self, rref_id: RRefId, fork_id: ForkId | None) -> None:
        """A Python RRef object is gone (scheduled on the loop by ``RRef.__del__``)."""
        if self.closed:
            return
        with self._lock:
            try:
                if fork_id is None:
                    actions = self.counter.drop_local_handle(rref_id)
                else:
                    actions = self.counter.release_user(fork_id)
            except LocalProtocolError:
                return  # already released by a graceful shutdown
        self._unusable.pop(fork_id, None) if fork_id is not None else None
        self.apply(actions)

    def schedule_release(self, rref_id: RRefId, fork_id: ForkId | None) -> None:
        # From __del__, on any thread: no I/O here, just a hand-off to the loop.
        if self.closed or self.loop.is_closed():
            return
        if fork_id is None and self._drop_own_handle_here(rref_id):
            return
        if asyncio._get_running_loop() is not self.loop:  # dropped on another thread
            handoffs.count("thread_to_loop")
        with contextlib.suppress(RuntimeError):  # the loop closed in between
            self.loop.call_soon_threadsafe(self.release, rref_id, fork_id)

    def _drop_own_handle_here(self, rref_id: RRefId) -> bool:
        """Drop one of the owner's own handles on this thread, if it can take the lock at
        once; False (nothing done) if it cannot.

        Such a drop is bookkeeping: no message, at most a ``Free``. An RRef that comes home
        as a call's argument (``rpc_sync(owner, f, (rref, x))``, every step of a model
        behind RRefs) is dropped on the lane thread that served the call; handing each
        drop to the loop woke the loop thread once per call, to take the GIL beside the
        lane thread that is writing the reply. ``__del__`` runs wherever the last
        reference went, maybe inside this very lock: a lock held, by this thread or
        another, sends the drop the loop's way.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            actions = self.counter.drop_local_handle(rref_id)
        except LocalProtocolError:
            actions = []  # already released by a graceful shutdown
        finally:
            self._lock.release()
        if actions:  # a Free: the value goes on the loop, as every action does
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self.loop.call_soon_threadsafe(self.apply, actions)
        return True

    # -- messages and failures -------------------------------------------------------------

    def on_message(self, peer: int, message: RefMessage) -> None:
        """A refcount message from ``peer`` (the loop)."""
        cls = _FROM_WIRE[message.op]
        ref_message = cls(RRefId(*message.rref_id), ForkId(*message.fork_id))
        with self._lock:
            actions = self.counter.on_message(peer, ref_message)
            confirmed = None
            if cls is ForkAccepted:
                confirmed = self._confirming.pop(ref_message.fork_id, None)
        self.apply(actions)
        if confirmed is not None:
            try_set_result(confirmed[1], None)

    def on_lane_ack(self, peer: int, forks: list[ForkPair]) -> None:
        """``peer``'s Ack, on a lane, of a remote() request carrying ``forks`` (the caller's
        own fork of the new RRef): the lane's server writes it once ``on_remote_request``
        registered that fork, as the ForkAccepted sent on the loop's connection says,
        which may arrive after the lane's next reply. Taken as that message now (any
        thread); the later one is a duplicate the counter ignores."""
        for rref_id, fork_id in forks:
            self.on_message(peer, RefMessage(_TO_WIRE[ForkAccepted], rref_id, fork_id))

    def on_peer_lost(self, rank: int) -> None:
        with self._lock:
            actions = self.counter.peer_lost(rank)
            lost = [fork for fork, (owner, _) in self._confirming.items() if owner == rank]
            waiting = [self._confirming.pop(fork)[1] for fork in lost]
        self.apply(actions)
        for confirming in waiting:  # the calls run, and meet the owner's loss themselves
            try_set_result(confirming, None)

    def take_unconfirmed(self) -> Future[Any] | None:
        """A future done once every fork unpickled since the last call is confirmed by its
        owner, or None if all are (the dispatcher runs a request's function after that)."""
        if not self._loaded:  # the common case, without the lock: nothing was unpickled
            return None
        with self._lock:
            loaded, self._loaded = self._loaded, []
        pending = [f for f in loaded if not f.done()]
        return collect_all(pending) if pending else None

    def apply(self, actions: list[Action]) -> None:
        """Carry out the state machine's actions, on the loop thread (now, if this is it)."""
        if actions:
            self._loop.run_on_loop(self._carry_out, actions)

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                message = action.message
                fields = RefMessage(_TO_WIRE[type(message)], message.rref_id, message.fork_id)
                self._frames.send_ref(action.dest, encode_frame(fields.to_fields(), b""))
            elif isinstance(action, Free):
                self._values.pop(action.rref_id, None)
            elif isinstance(action, RRefLost):
                self._lost[action.rref_id] = action.worker
            elif isinstance(action, RemoteUndelivered):
                owner = self.worker_info(action.owner).name
                self._unusable[action.fork_id] = RRefError(
                    f"the remote() request that was to create RRef {tuple(action.rref_id)} on "
                    f"worker {owner!r} was lost with its connection: the value was never made"
                )

    # -- what RRef handles ask (see asyncrpc/rref/handle.py) ------------------------------

    async def run_in_pool(self, fn: Callable[[], Any]) -> Any:
        return await self._loop.run_in_pool(fn)

    # -- state queries for RRef ------------------------------------------------------------

    def check_usable(self, rref: RRef[Any]) -> None:
        """Raise the typed error that makes ``rref`` unusable, if any."""
        fork_id = rref._fork_id
        if fork_id is not None and fork_id in self._unusable:
            raise self._unusable[fork_id]
        lost = self._lost.get(rref._rref_id)
        if lost is not None:
            raise RRefOwnerLostError(self.worker_info(lost).name, "the owner died")
        if self.closed:
            raise RRefError(
                f"worker {self.name!r} is shut down and this RRef was deleted with it: "
                "Cannot call to_here() on it after deletion."
            )

    def confirmed(self, rref: RRef[Any]) -> bool:
        if rref._fork_id is None:
            return True
        with self._lock:
            try:
                return self.counter.is_confirmed(rref._fork_id)
            except LocalProtocolError:
                return False

    # -- shutdown and introspection --------------------------------------------------------

    def release_all_users(self) -> None:
        with self._lock:
            actions = self.counter.release_all_users()
        self.apply(actions)

    def quiescent(self) -> bool:
        with self._lock:
            return self.counter.quiescent()

    def owner_leaks(self) -> list[RRefId]:
        """Owned values that users elsewhere still reference (local handles not counted)."""
        with self._lock:
            return self.counter.remotely_held()

    def report_leaks(self) -> None:
        leaks = self.owner_leaks()
        if not leaks:
            return
        message = (
            f"worker {self.name!r} shuts down with {len(leaks)} owner RRef(s) still "
            f"referenced by other workers: {leaks[:10]}"
        )
        if self._rref_leaks == "error":
            raise ShutdownError(message)
        if self._rref_leaks == "warn":
            _log.warning(message)

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            return {**self.counter.debug_info(), "forks_queried": self._queried}

    def describe(self) -> dict[str, list[str]]:
        """The entries behind ``debug_info``'s counts (``RefTables.describe``)."""
        with self._lock:
            return self.counter.describe()

    def close(self) -> None:
        self.closed = True
        with self._lock:
            waiting = [confirming for _, confirming in self._confirming.values()]
            self._confirming.clear()
        for confirming in waiting:
            try_set_result(confirming, None)
        error = RRefError(f"worker {self.name!r} shut down")
        for value in self._values.values():
            if not value.done():
                value.set_exception(own_copy(error))
        self._values.clear()
