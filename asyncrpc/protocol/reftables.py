"""The tables of one worker's RRef reference counts and their read-only queries
(layer L1, sans-I/O).

``RefTables`` holds what ``RefCounter`` (``refcount.py``) knows: owned RRefs and their forks,
user forks, pending children, tombstones. Every transition that changes them is in
``refcount.py``; here are the state, the id counter, the queries and the lookups it uses.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from asyncrpc.errors import LocalProtocolError, RRefError, RRefOwnerLostError
from asyncrpc.protocol.refmessages import ForkId, RRefId

__all__ = ["OwnedEntry", "RefTables", "UserFork", "UserState"]


class UserState(enum.Enum):
    """What the agent may do with a user fork (see :meth:`RefTables.user_state`)."""

    UNCONFIRMED = "unconfirmed"  # usable; the owner has not confirmed it yet
    CONFIRMED = "confirmed"  # usable
    RELEASED = "released"  # handle released; its UserDelete waits on confirmation/children
    TIMED_OUT = "timed_out"  # unusable: the agent gave up waiting for the confirmation
    OWNER_LOST = "owner_lost"  # unusable: the owner is gone


# -- entries (changed only by refcount.py's transitions) -----------------------------------


@dataclass(slots=True)
class OwnedEntry:
    """Owner-side entry. ``created`` is False for a placeholder awaiting its remote()."""

    forks: dict[ForkId, int] = field(default_factory=dict)  # registered fork -> holder
    local: int = 0  # the owner's own handles
    created: bool = True


@dataclass(slots=True)
class UserFork:
    """User-side entry of one fork. ``parent`` is the worker that pickled it to us (None for
    our own remote() fork). The entry outlives its UserDelete only while ``handle`` is held
    (a timed-out fork), and outlives the owner only while ``handle`` is held (a lost fork)."""

    rref_id: RRefId
    owner: int
    parent: int | None
    confirmed: bool
    handle: bool = True  # the agent's Python object still holds it
    timed_out: bool = False
    lost: bool = False
    deleted: bool = False  # UserDelete sent
    children: dict[ForkId, int] | None = None  # pending child -> its holder (lazily made)


def _name(ident: RRefId | ForkId) -> str:
    return f"{ident.worker}:{ident.local_id}"


class _Window:
    """A set remembering only its ``limit`` newest members: bounded tombstones."""

    __slots__ = ("_limit", "_members", "_order")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._members: set[tuple[int, int]] = set()
        self._order: deque[tuple[int, int]] = deque()

    def add(self, item: tuple[int, int]) -> None:
        if item in self._members:
            return
        self._members.add(item)
        self._order.append(item)
        if len(self._order) > self._limit:
            self._members.discard(self._order.popleft())

    def __contains__(self, item: object) -> bool:
        return item in self._members


class RefTables:
    """One worker's reference-count state, with its queries (``RefCounter`` changes it).

    Args:
        self_rank: this worker's rank.
        tombstone_limit: how many deleted fork ids and freed RRef ids are remembered to
            reject duplicate messages. TCP never duplicates, so this is defence in depth: a
            duplicate older than that many deletions could leave an owner entry behind (a
            leak, never a premature free).
    """

    __slots__ = (
        "_child_parent",
        "_deleted",
        "_freed",
        "_lost",
        "_owned",
        "_seen",
        "_serial",
        "_undone",
        "_users",
        "rank",
    )

    def __init__(self, self_rank: int, *, tombstone_limit: int = 65536) -> None:
        self.rank = self_rank
        self._serial = 0
        self._owned: dict[RRefId, OwnedEntry] = {}
        self._users: dict[ForkId, UserFork] = {}
        self._child_parent: dict[ForkId, ForkId] = {}  # pending child -> our parent fork
        self._lost: set[int] = set()  # peers reported lost (for good)
        self._deleted = _Window(tombstone_limit)  # fork ids whose UserDelete arrived
        self._freed = _Window(tombstone_limit)  # freed RRefs minted by other workers
        self._seen = _Window(tombstone_limit)  # fork ids that arrived here (for ForkQuery)
        self._undone = 0  # forks undone because their frame never arrived

    # -- ids -------------------------------------------------------------------------------

    def next_rref_id(self) -> RRefId:
        """Mint a new RRef id on this worker (for ``RRef(value)`` and for ``remote()``).

        Returns:
            A new id, unique in the group.
        """
        serial = self._serial  # from 0, one counter for RRefs and forks, as torch numbers them
        self._serial = serial + 1
        return RRefId(self.rank, serial)

    def _next_fork_id(self) -> ForkId:
        serial = self._serial
        self._serial = serial + 1
        return ForkId(self.rank, serial)

    # -- queries ---------------------------------------------------------------------------

    def quiescent(self) -> bool:
        """Whether this worker owes nothing as a user: no fork to confirm or delete, no
        pending child (forks kept only for a held handle of a dead or deleted fork do not
        count)."""
        return all(e.deleted or e.lost for e in self._users.values())

    def remotely_held(self) -> list[RRefId]:
        """RRefs owned here that some other worker still holds a fork of (the real leaks
        at shutdown: the owner's own local handles are not counted)."""
        return [rref_id for rref_id, entry in self._owned.items() if entry.forks]

    def owner_leaks(self) -> list[RRefId]:
        """RRefs still owned here (placeholders included), for the leak report."""
        return list(self._owned)

    def debug_info(self) -> dict[str, int]:
        """Counts for ``get_debug_info``: owned RRefs, active user forks, pending children,
        unconfirmed user forks, forks undone because their frame was lost."""
        active = [e for e in self._users.values() if not (e.deleted or e.lost)]
        return {
            "owner_rrefs": len(self._owned),
            "user_rrefs": len(active),
            "pending_forks": len(self._child_parent),
            "pending_users": sum(1 for e in active if not e.confirmed),
            "forks_undelivered": self._undone,
        }

    def describe(self, limit: int = 20) -> dict[str, list[str]]:
        """What is left, one line per entry (at most ``limit`` of each): owned RRefs with
        the forks they wait for and who holds them, and active user forks with their
        state. For leak reports: which RRef, which worker, in which state."""
        owned = [
            f"rref {_name(rref_id)} local={entry.local} created={entry.created} forks="
            + ",".join(f"{_name(fork)}@{holder}" for fork, holder in entry.forks.items())
            for rref_id, entry in list(self._owned.items())[:limit]
        ]
        users = [
            f"fork {_name(fork_id)} of {_name(e.rref_id)} owner={e.owner} parent={e.parent} "
            f"confirmed={e.confirmed} handle={e.handle} timed_out={e.timed_out} "
            f"children={sorted(_name(c) for c in e.children or {})}"
            for fork_id, e in list(self._users.items())
            if not (e.deleted or e.lost)
        ][:limit]
        pending = [
            f"fork {_name(child)} under {_name(parent)}"
            for child, parent in self._child_parent.items()
        ]
        return {"owned": owned, "users": users, "pending_children": pending[:limit]}

    def user_state(self, fork_id: ForkId) -> UserState:
        """The state of a user fork this worker tracks.

        Raises:
            LocalProtocolError: unknown fork (released and deleted, or never here).
        """
        entry = self._user_entry(fork_id)
        if entry.lost:
            return UserState.OWNER_LOST
        if entry.timed_out:
            return UserState.TIMED_OUT
        if not entry.handle:
            return UserState.RELEASED
        return UserState.CONFIRMED if entry.confirmed else UserState.UNCONFIRMED

    def is_confirmed(self, fork_id: ForkId) -> bool:
        """Whether the owner registered ``fork_id``.

        Raises:
            LocalProtocolError: unknown fork.
        """
        return self._user_entry(fork_id).confirmed

    # -- internals -------------------------------------------------------------------------

    def _owner_entry(self, rref_id: RRefId) -> OwnedEntry:
        entry = self._owned.get(rref_id)
        if entry is None:  # the agent only calls these while it holds the value: our bug
            raise LocalProtocolError(f"this worker owns no RRef {rref_id}")
        return entry

    def _user_entry(self, fork_id: ForkId) -> UserFork:
        entry = self._users.get(fork_id)
        if entry is None:  # the agent asks only about forks it holds: our bug
            raise LocalProtocolError(f"unknown user fork {fork_id}")
        return entry

    def _usable(self, rref_id: RRefId, fork_id: ForkId) -> UserFork:
        entry = self._users.get(fork_id)
        if entry is None or not entry.handle or entry.rref_id != rref_id:
            raise LocalProtocolError(f"fork {fork_id} of {rref_id} is not held here")
        if entry.lost:
            raise RRefOwnerLostError(f"rank {entry.owner}", "owner lost")
        if entry.timed_out:
            raise RRefError(f"RRef {rref_id} timed out and is unusable")
        return entry

    def _check_alive(self, worker: int) -> None:
        if worker in self._lost:  # the agent checks liveness before pickling: our bug
            raise LocalProtocolError(f"worker {worker} was reported lost")

    def on_its_way(self, rref_id: RRefId) -> bool:
        """Whether the remote() that creates ``rref_id`` here may still be on its way: not
        owned here, and not known to be freed (a fetch by id may then wait for it)."""
        return rref_id not in self._owned and not self._known_freed(rref_id)

    def _known_freed(self, rref_id: RRefId) -> bool:
        # Unknown here and minted here (created before any fork existed), or minted by a
        # lost worker (its remote() will never come), or remembered as freed.
        return rref_id.worker == self.rank or rref_id.worker in self._lost or rref_id in self._freed
