"""Distributed reference counting of RRefs as a pure state machine (layer L1, sans-I/O).

Each worker owns one :class:`RefCounter`. The agent feeds it events (handles created and
dropped, RRefs pickled and unpickled, refcount messages from peers, lost peers) and carries
out the actions it returns: :class:`Send` a message, :class:`Free` a value, :class:`RRefLost`.
The ids, messages and actions, and the protocol they carry, are ``refmessages.py``.
"""

from __future__ import annotations

from asyncrpc.errors import (
    LocalProtocolError,
    RemoteProtocolError,
)
from asyncrpc.protocol.refmessages import (
    Action,
    ChildAccepted,
    ForkAccepted,
    ForkId,
    ForkQuery,
    ForkRequest,
    ForkUnknown,
    Free,
    Message,
    RemoteUndelivered,
    RRefId,
    RRefLost,
    Send,
    UserDelete,
)
from asyncrpc.protocol.reftables import OwnedEntry, RefTables, UserFork, UserState

__all__ = ["RefCounter", "UserState"]


class RefCounter(RefTables):
    """One worker's reference counts, as owner of some RRefs and user of others.

    Every event method returns the list of actions the agent must carry out, in order.
    Events that only a bug on this side can produce (releasing an unknown fork...) raise
    ``LocalProtocolError``; messages from peers that name unknown ids are ignored. Its
    constructor is ``RefTables``' (``self_rank``, ``tombstone_limit``).
    """

    __slots__ = ()  # the state is RefTables's

    # -- owner role ------------------------------------------------------------------------

    def new_owner(
        self, rref_id: RRefId, *, holder: int | None = None, fork_id: ForkId | None = None
    ) -> list[Action]:
        """Record a value created here.

        Call it as soon as a remote() request is decoded (before running the function), or
        when ``RRef(value)`` is made locally (no holder: it starts with one local handle).

        Args:
            rref_id: the RRef; for remote() the caller minted it with ``next_rref_id``.
            holder: the remote() caller, whose initial fork is ``fork_id``.
            fork_id: the caller's fork.

        Returns:
            ``[Send(holder, ForkAccepted)]`` for remote(), else ``[]``.

        Raises:
            LocalProtocolError: holder and fork_id not given together, holder is this worker
                or a lost peer, or ``rref_id`` was already created.
        """
        if (holder is None) != (fork_id is None) or holder == self.rank:
            raise LocalProtocolError("give holder and fork_id together, for a remote caller")
        if holder is not None and holder in self._lost:
            raise LocalProtocolError(f"worker {holder} was reported lost")
        entry = self._owned.get(rref_id)
        if entry is None:
            entry = self._owned[rref_id] = OwnedEntry()
        elif entry.created:
            raise LocalProtocolError(f"RRef {rref_id} created twice")
        else:
            entry.created = True  # fills a placeholder an early ForkRequest made
        if holder is None or fork_id is None:
            entry.local += 1
            return []
        self._seen.add(fork_id)
        entry.forks[fork_id] = holder
        return [Send(holder, ForkAccepted(rref_id, fork_id))]

    def add_local_handle(self, rref_id: RRefId) -> None:
        """Count one more of the owner's own Python handles on ``rref_id``.

        Raises:
            LocalProtocolError: this worker owns no such RRef.
        """
        self._owner_entry(rref_id).local += 1

    def drop_local_handle(self, rref_id: RRefId) -> list[Action]:
        """One of the owner's own handles on ``rref_id`` is gone.

        Returns:
            ``[Free(rref_id)]`` when that was the last reference, else ``[]``.

        Raises:
            LocalProtocolError: unknown RRef, or no local handle left to drop.
        """
        entry = self._owner_entry(rref_id)
        if entry.local == 0:
            raise LocalProtocolError(f"no local handle left on RRef {rref_id}")
        entry.local -= 1
        return self._maybe_free(rref_id, entry)

    def fork_from_owner(self, rref_id: RRefId, dest: int) -> ForkId:
        """The owner pickles its RRef for ``dest``; the fork is registered at once.

        ``dest`` may be this worker: unpickling it here (``received_own``) swaps the fork
        for a local handle. If the message never arrives, ``peer_lost(dest)`` drops it.

        Returns:
            The fork id to pickle (with parent = this worker).

        Raises:
            LocalProtocolError: unknown RRef, or ``dest`` was reported lost.
        """
        entry = self._owner_entry(rref_id)
        self._check_alive(dest)
        fork_id = self._next_fork_id()
        entry.forks[fork_id] = dest
        return fork_id

    def on_fork_request(self, sender: int, message: ForkRequest) -> list[Action]:
        """A user asks to register its fork. Idempotent.

        Returns:
            ``[Send(sender, ForkAccepted)]``, also when nothing is registered (a duplicate, a
            deleted fork, or an RRef freed after a peer failure) so the sender can settle;
            ``[]`` if the sender was reported lost.
        """
        if sender in self._lost:
            return []  # the agent should drop a lost peer's frames; be safe anyway
        rref_id, fork_id = message.rref_id, message.fork_id
        reply: list[Action] = [Send(sender, ForkAccepted(rref_id, fork_id))]
        if fork_id in self._deleted:
            return reply  # a duplicate after its UserDelete must not resurrect it
        entry = self._owned.get(rref_id)
        if entry is None:
            if self._known_freed(rref_id):
                return reply
            # The remote() that creates it has not arrived yet (see the block comment above).
            entry = self._owned[rref_id] = OwnedEntry(created=False)
        entry.forks[fork_id] = sender
        return reply

    def on_user_delete(self, sender: int, message: UserDelete) -> list[Action]:
        """A user dropped its fork. Idempotent; unknown ids are late duplicates.

        Returns:
            ``[Free(rref_id)]`` when that was the last reference, else ``[]``.
        """
        if sender in self._lost:
            return []
        self._deleted.add(message.fork_id)
        entry = self._owned.get(message.rref_id)
        if entry is None or entry.forks.pop(message.fork_id, None) is None:
            return []
        return self._maybe_free(message.rref_id, entry)

    def received_own(self, rref_id: RRefId, fork_id: ForkId, parent: int) -> list[Action]:
        """This owner unpickled its own RRef, pickled by ``parent``.

        Design: the unpickled object counts as ONE LOCAL HANDLE, added here (so no free can
        slip in before the agent builds it); the agent's object later calls
        ``drop_local_handle`` once, and never ``add_local_handle`` for it. No fork is
        registered for ``fork_id``: the parent only waits for ``ChildAccepted``.

        Returns:
            ``[Send(parent, ChildAccepted)]`` (``[]`` if parent is this worker or lost). With
            an ``RRefLost(rref_id, self.rank)`` and no handle added if the value was already
            freed (only after a peer failure): the agent makes a dead object then.

        Raises:
            LocalProtocolError: parent is this worker but ``fork_id`` is not a fork it made.
        """
        entry = self._owned.get(rref_id)
        self._seen.add(fork_id)
        if parent == self.rank:
            # fork_from_owner(dest=self) registered fork_id; swap it for a local handle.
            if entry is None or entry.forks.pop(fork_id, None) is None:
                raise LocalProtocolError(f"fork {fork_id} of {rref_id} was not made here")
            entry.local += 1
            return []
        actions: list[Action] = []
        if parent not in self._lost:
            actions.append(Send(parent, ChildAccepted(rref_id, fork_id)))
        if entry is None:
            if self._known_freed(rref_id):
                actions.append(RRefLost(rref_id, self.rank))
                return actions
            entry = self._owned[rref_id] = OwnedEntry(created=False)  # remote() still on its way
        entry.local += 1
        return actions

    def returned_home(self, rref_id: RRefId) -> list[Action]:
        """This owner unpickled its own RRef, sent home by a user without a fork.

        The user kept its own fork (see ``send_home``); the unpickled object counts as one
        local handle, as in ``received_own``, and nobody waits for an acknowledgement.

        Returns:
            ``[]``, or ``[RRefLost(rref_id, self.rank)]`` with no handle added when the value
            was already freed (only after a peer failure).
        """
        entry = self._owned.get(rref_id)
        if entry is None:
            if self._known_freed(rref_id):
                return [RRefLost(rref_id, self.rank)]
            entry = self._owned[rref_id] = OwnedEntry(created=False)  # remote() still on its way
        entry.local += 1
        return []

    # -- user role -------------------------------------------------------------------------

    def new_user(self, rref_id: RRefId, owner: int) -> tuple[ForkId, list[Action]]:
        """This worker calls remote() on ``owner``: make its first fork, unconfirmed.

        The agent sends the remote() request carrying ``rref_id`` and the fork id itself.

        Args:
            rref_id: minted by ``next_rref_id`` on this worker.
            owner: the callee.

        Returns:
            The fork id and ``[]``.

        Raises:
            LocalProtocolError: ``owner`` is this worker or lost, or ``rref_id`` was not minted
                here (the owner relies on ``rref_id.worker`` naming the caller).
        """
        if owner == self.rank or rref_id.worker != self.rank:
            raise LocalProtocolError("remote() RRefs are minted by the caller for another worker")
        self._check_alive(owner)
        fork_id = self._next_fork_id()
        self._users[fork_id] = UserFork(rref_id, owner, None, confirmed=False)
        return fork_id, []

    def send_home(self, rref_id: RRefId, fork_id: ForkId) -> int:
        """This user pickles its fork for the owner itself: no new fork is made.

        The owner counts what it unpickles as a local handle (``returned_home``). Nothing
        has to keep the value alive in between: this user's fork does, and its UserDelete
        can only leave after the message that carries the RRef home (both go to the owner,
        whose frames arrive in the order they were sent). That saves the fork's bookkeeping
        on both sides and the owner's ChildAccepted.

        Returns:
            The owner's rank.

        Raises:
            LocalProtocolError: unknown or released fork, ``rref_id`` mismatch.
            RRefOwnerLostError: the owner is gone.
            RRefError: the fork timed out.
        """
        entry = self._usable(rref_id, fork_id)
        self._check_alive(entry.owner)
        return entry.owner

    def fork_from_user(self, rref_id: RRefId, parent_fork: ForkId, dest: int) -> ForkId:
        """This user pickles its fork ``parent_fork`` for ``dest`` (which may be the owner).

        The new fork is a pending child of ``parent_fork`` until ``ChildAccepted`` arrives or
        ``dest`` is lost; meanwhile ``parent_fork`` sends no UserDelete.

        Returns:
            The child fork id to pickle (with parent = this worker).

        Raises:
            LocalProtocolError: unknown or released fork, ``rref_id`` mismatch, lost ``dest``.
            RRefOwnerLostError: the owner is gone.
            RRefError: the fork timed out.
        """
        entry = self._usable(rref_id, parent_fork)
        self._check_alive(dest)
        child = self._next_fork_id()
        if entry.children is None:
            entry.children = {}
        entry.children[child] = dest
        self._child_parent[child] = parent_fork
        return child

    def received_user(
        self, rref_id: RRefId, fork_id: ForkId, owner: int, parent: int
    ) -> list[Action]:
        """This worker unpickled a user fork pickled by ``parent``; it holds one handle.

        Returns:
            ``[]`` if ``parent`` is the owner (registered already), else
            ``[Send(owner, ForkRequest)]``; ``[RRefLost]`` (the fork is OWNER_LOST) if the owner
            was reported lost.

        Raises:
            LocalProtocolError: ``owner`` is this worker (use ``received_own``).
            RemoteProtocolError: the same fork arrived twice.
        """
        if owner == self.rank:
            raise LocalProtocolError("an own RRef coming home goes to received_own")
        if fork_id in self._users:
            raise RemoteProtocolError(f"fork {fork_id} of {rref_id} delivered twice")
        self._seen.add(fork_id)
        entry = UserFork(rref_id, owner, parent, confirmed=parent == owner)
        self._users[fork_id] = entry
        if owner in self._lost:
            entry.lost = True
            return [RRefLost(rref_id, owner)]
        return [] if entry.confirmed else [Send(owner, ForkRequest(rref_id, fork_id))]

    def on_fork_accepted(self, message: ForkAccepted) -> list[Action]:
        """The owner registered our fork. Idempotent; unknown forks are late duplicates.

        Returns:
            ``Send(parent, ChildAccepted)`` if a remote user pickled the fork to us (a parent
            on this worker is handled inline), then our UserDelete if it was deferred.
        """
        fork_id = message.fork_id
        entry = self._users.get(fork_id)
        if entry is None or entry.confirmed or entry.lost or entry.rref_id != message.rref_id:
            return []
        entry.confirmed = True
        actions: list[Action] = []
        parent = entry.parent
        if parent is not None and parent != entry.owner:
            if parent == self.rank:
                actions = self._child_accepted(message.rref_id, fork_id)
            elif parent not in self._lost:
                actions.append(Send(parent, ChildAccepted(message.rref_id, fork_id)))
        actions += self._maybe_delete(fork_id, entry)
        return actions

    def on_child_accepted(self, message: ChildAccepted) -> list[Action]:
        """A child of one of our forks is registered. Idempotent.

        Returns:
            The parent's deferred ``[Send(owner, UserDelete)]`` if it is now due, else ``[]``.
        """
        return self._child_accepted(message.rref_id, message.fork_id)

    def release_user(self, fork_id: ForkId) -> list[Action]:
        """The agent's Python handle of ``fork_id`` is gone (call exactly once per fork, also
        for timed-out and owner-lost forks).

        Returns:
            ``[Send(owner, UserDelete)]`` now, or ``[]`` if it is deferred until the fork is
            confirmed and has no pending child (or is not needed any more).

        Raises:
            LocalProtocolError: unknown fork or released twice.
        """
        entry = self._users.get(fork_id)
        if entry is None or not entry.handle:
            raise LocalProtocolError(f"release of unknown or released fork {fork_id}")
        entry.handle = False
        if entry.deleted or entry.lost:
            del self._users[fork_id]
            return []
        return self._maybe_delete(fork_id, entry)

    def timeout_user(self, fork_id: ForkId) -> list[Action]:
        """Mark ``fork_id`` unusable (its remote() was not confirmed in time).

        The protocol then treats it as released: its UserDelete goes out once it is
        confirmed and childless, so the owner cannot leak. The agent's handle still calls
        ``release_user`` once when it goes away.

        Returns:
            ``[Send(owner, UserDelete)]`` if that is possible already, else ``[]``.

        Raises:
            LocalProtocolError: unknown fork.
        """
        entry = self._user_entry(fork_id)
        entry.timed_out = True
        return self._maybe_delete(fork_id, entry)

    # -- frames lost with a connection ------------------------------------------------------

    def on_fork_query(self, sender: int, message: ForkQuery) -> list[Action]:
        """``sender`` asks whether ``fork_id`` arrived here (see the block comment above).

        Returns:
            ``[Send(sender, ForkUnknown)]`` if it never did, else ``[]``. If it was the
            remote() that was to create ``rref_id`` here, that value will never exist: a
            placeholder made for it by early forks ends as ``_lose_holder`` ends one.
        """
        rref_id = message.rref_id
        if message.fork_id in self._seen:
            return []
        actions: list[Action] = [Send(sender, ForkUnknown(rref_id, message.fork_id))]
        if rref_id.worker == sender:
            # Only an owner holds a placeholder, and forks sent to their owner carry no
            # fork id (send_home): so a placeholder here means the lost frame was its remote().
            entry = self._owned.get(rref_id)
            if entry is None:
                self._freed.add(rref_id)  # harmless where this worker is not the owner
            elif not entry.created:
                entry.created = True
                actions.append(RRefLost(rref_id, sender))
                actions += self._maybe_free(rref_id, entry)
        return actions

    def undelivered(self, dest: int, rref_id: RRefId, fork_id: ForkId) -> list[Action]:
        """The frame carrying ``fork_id`` to ``dest`` never arrived: undo the fork.

        Idempotent; a fork that is not (or no longer) pending for ``dest`` is ignored.

        Returns:
            ``Free`` if an owner fork was the last reference; a deferred ``UserDelete`` if a
            pending child was the last thing holding its parent; ``RemoteUndelivered`` for
            the fork of a remote() whose request was lost.
        """
        owned = self._owned.get(rref_id)
        if owned is not None and owned.forks.get(fork_id) == dest:
            del owned.forks[fork_id]  # fork_from_owner
            self._undone += 1
            return self._maybe_free(rref_id, owned)
        parent_fork = self._child_parent.get(fork_id)
        if parent_fork is not None:  # fork_from_user
            parent = self._users[parent_fork]
            if parent.rref_id != rref_id or parent.children is None:
                return []
            if parent.children.get(fork_id) != dest:
                return []
            del parent.children[fork_id]
            del self._child_parent[fork_id]
            self._undone += 1
            return self._maybe_delete(parent_fork, parent)
        entry = self._users.get(fork_id)
        if (
            entry is None
            or entry.rref_id != rref_id
            or entry.parent is not None
            or entry.owner != dest
            or entry.confirmed
            or entry.lost
        ):
            return []
        # new_user: the owner never made the value, so nothing needs deleting.
        self._undone += 1
        entry.lost = True
        self._drop_children(entry)
        if not entry.handle:
            del self._users[fork_id]
        return [RemoteUndelivered(rref_id, fork_id, dest)]

    # -- failures and shutdown -------------------------------------------------------------

    def peer_lost(self, worker: int) -> list[Action]:
        """``worker`` is gone for good; the agent then drops every frame from it.

        As owner: drop the forks it held, give up placeholders its remote() would have
        filled. As user: forget pending children it held (deferred deletes may follow);
        every fork it owned becomes OWNER_LOST with one ``RRefLost`` per RRef.

        Returns:
            The resulting Send, Free and RRefLost actions. Idempotent.

        Raises:
            LocalProtocolError: ``worker`` is this worker.
        """
        if worker == self.rank:
            raise LocalProtocolError("a worker cannot lose itself")
        if worker in self._lost:
            return []
        self._lost.add(worker)
        actions = self._lose_owner(worker)  # first, so no UserDelete goes to the lost owner
        actions += self._lose_children(worker)
        actions += self._lose_holder(worker)
        return actions

    def release_all_users(self) -> list[Action]:
        """Release every user handle still held (graceful shutdown).

        Returns:
            The UserDeletes due now; deferred ones come from later events.
        """
        actions: list[Action] = []
        for fork_id, entry in list(self._users.items()):
            if entry.handle:
                actions += self.release_user(fork_id)
        return actions

    def on_message(self, sender: int, message: Message) -> list[Action]:
        """Dispatch a refcount message from ``sender`` to its handler.

        Returns:
            The handler's actions.
        """
        if isinstance(message, ForkRequest):
            return self.on_fork_request(sender, message)
        if isinstance(message, UserDelete):
            return self.on_user_delete(sender, message)
        if sender in self._lost:
            return []
        if isinstance(message, ForkQuery | ForkUnknown):
            return self._on_frame_lost(sender, message)
        if isinstance(message, ForkAccepted):
            return self.on_fork_accepted(message)
        return self.on_child_accepted(message)

    def _on_frame_lost(self, sender: int, message: ForkQuery | ForkUnknown) -> list[Action]:
        if isinstance(message, ForkQuery):
            return self.on_fork_query(sender, message)
        return self.undelivered(sender, message.rref_id, message.fork_id)

    # -- internals -------------------------------------------------------------------------

    def _maybe_free(self, rref_id: RRefId, entry: OwnedEntry) -> list[Action]:
        if entry.forks or entry.local or not entry.created:
            return []
        del self._owned[rref_id]
        if rref_id.worker != self.rank:
            self._freed.add(rref_id)
        return [Free(rref_id)]

    def _maybe_delete(self, fork_id: ForkId, entry: UserFork) -> list[Action]:
        if (
            entry.deleted
            or entry.lost
            or not entry.confirmed
            or entry.children
            or (entry.handle and not entry.timed_out)
        ):
            return []
        entry.deleted = True
        if not entry.handle:
            del self._users[fork_id]
        return [Send(entry.owner, UserDelete(entry.rref_id, fork_id))]

    def _child_accepted(self, rref_id: RRefId, child: ForkId) -> list[Action]:
        parent_fork = self._child_parent.get(child)
        if parent_fork is None:
            return []  # duplicate, or its holder was lost
        entry = self._users[parent_fork]
        if entry.rref_id != rref_id or entry.children is None:
            return []
        del self._child_parent[child]
        del entry.children[child]
        return self._maybe_delete(parent_fork, entry)

    def _drop_children(self, entry: UserFork) -> None:
        if entry.children:
            for child in entry.children:
                del self._child_parent[child]
            entry.children.clear()

    def _lose_owner(self, worker: int) -> list[Action]:
        lost: dict[RRefId, None] = {}  # ordered set: one notice per RRef
        for fork_id, entry in list(self._users.items()):
            if entry.owner == worker and not entry.lost:
                entry.lost = True
                self._drop_children(entry)
                if not entry.handle:
                    del self._users[fork_id]
                lost[entry.rref_id] = None
        return [RRefLost(rref_id, worker) for rref_id in lost]

    def _lose_children(self, worker: int) -> list[Action]:
        parents: dict[ForkId, UserFork] = {}
        for child, parent_fork in list(self._child_parent.items()):
            entry = self._users[parent_fork]
            if entry.children is not None and entry.children.get(child) == worker:
                del entry.children[child]
                del self._child_parent[child]
                parents[parent_fork] = entry
        actions: list[Action] = []
        for fork_id, entry in parents.items():
            actions += self._maybe_delete(fork_id, entry)
        return actions

    def _lose_holder(self, worker: int) -> list[Action]:
        actions: list[Action] = []
        for rref_id, entry in list(self._owned.items()):
            if not entry.created and rref_id.worker == worker:
                entry.created = True  # its remote() died with the caller: give up waiting
                actions.append(RRefLost(rref_id, worker))
            dead = [fork_id for fork_id, holder in entry.forks.items() if holder == worker]
            for fork_id in dead:
                del entry.forks[fork_id]
            actions += self._maybe_free(rref_id, entry)
        return actions
