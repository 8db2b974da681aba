"""Who is in the group: addresses by rank and ranks by name, and, in a dynamic group, how
a worker learns of members it has not met yet: it reads them in the rendezvous store (L2).

Every member of a static group has published its address once ``init_rpc`` returns; a
worker reads one the first time it needs it (a call or an RRef naming it, its Hello), then
keeps it, so a worker of a large group reads only the addresses of the peers it talks to.
A dynamic member knows the members that were there when it joined; a later one is looked
up the same way. Look-ups block on a
few store round trips: the agent makes them on a helper thread or on the calling thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from asyncrpc.errors import BadDestinationError, PeerUnavailableError, UnknownWorkerError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.options import WorkerInfo
from asyncrpc.runtime.group.rendezvous import StoreGroup
from asyncrpc.runtime.group.stores import first_line

__all__ = ["Directory"]

_log = logging.getLogger(__name__)


class Directory:
    """The members this worker knows, and (dynamic group) the store to find more in."""

    def __init__(self, addresses: dict[int, PeerAddress], group: StoreGroup | None) -> None:
        self.addresses = addresses  # the group's own dict: entries are only ever added
        self.ranks_by_name = {a.name: r for r, a in addresses.items()}
        self._group = group
        # Told of each member of a dynamic group met after joining (membership events).
        self.on_joined: Callable[[WorkerInfo], None] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether members come and go (a dynamic group)."""
        return self._group is not None and self._group.dynamic

    @property
    def lazy(self) -> bool:
        """Whether members not met yet are read in the store (any group with a store: a
        static group's addresses are read when first needed, not all at init)."""
        return self._group is not None

    def known(self, who: str | int) -> int | None:
        """The rank of ``who`` (a name or a rank) if this worker knows it; never blocks."""
        if isinstance(who, str):
            return self.ranks_by_name.get(who)
        return who if who in self.addresses else None

    def learn(self, address: PeerAddress) -> None:
        # Callers on any thread: the address goes in first, so whoever finds the name
        # finds its address too (each dict assignment is atomic).
        new = address.rank not in self.addresses
        self.addresses[address.rank] = address
        self.ranks_by_name[address.name] = address.rank
        if new and self.on_joined is not None and self.dynamic:
            self.on_joined(WorkerInfo(address.name, address.rank))

    def lookup(self, who: str | int) -> int | None:
        """The rank of ``who``, read in the store if not known yet (blocking); None if no
        such member has joined (or the store cannot be reached: logged)."""
        try:
            return self._read(who)
        except (RuntimeError, OSError) as exc:  # the store's host has gone
            _log.warning("could not look up worker %r in the rendezvous store: %s", who, exc)
            return None

    def _read(self, who: str | int) -> int | None:
        """``lookup``, raising the store's error when it cannot be reached."""
        rank = self.known(who)
        if rank is not None or self._group is None:
            return rank
        address = self._group.find(who)
        if address is None:
            return None
        self.learn(address)
        _log.debug("learned of worker %r (rank %d)", address.name, address.rank)
        return address.rank

    async def lookup_async(self, who: str | int) -> int | None:
        """``lookup`` on a helper thread, so the loop keeps serving; at once when known."""
        rank = self.known(who)
        if rank is not None or self._group is None:
            return rank
        return await asyncio.get_running_loop().run_in_executor(None, self.lookup, who)

    def current(self) -> list[int]:
        """Ranks of the group's members now, by rank (blocking in a dynamic group: every
        listed member not known yet is read, and those that have left are left out)."""
        group = self._group
        if group is None:
            return sorted(self.addresses)
        if group.world_size is not None:
            return list(range(group.world_size))
        try:
            ranks = group.member_ranks()
            for rank in ranks:
                if rank not in self.addresses:
                    self.lookup(rank)
            here = [r for r in ranks if r in self.addresses and not group.has_left(r)]
        except (RuntimeError, OSError) as exc:
            _log.warning("could not read the members in the rendezvous store: %s", exc)
            return sorted(self.addresses)
        return sorted(set(here) | {group.rank})

    # -- addressing ------------------------------------------------------------------------

    def resolve(self, to: object) -> int:
        """Return the rank of worker ``to`` (a name, a rank or a ``WorkerInfo``).

        A member met for the first time (any group: a static group's addresses are read
        on first use too) is read in the store, on the calling thread (a short blocking
        read, once per member).

        Raises:
            UnknownWorkerError: no such worker in the group.
            BadDestinationError: ``to`` names no worker at all.
            PeerUnavailableError: a member not met yet whose address cannot be read: the
                rendezvous store no longer answers (its host, rank 0, has gone).
        """
        who = self.destination(to)
        rank = self.known(who)
        if rank is None and self.lazy:
            try:
                rank = self._read(who)
            except (RuntimeError, OSError) as exc:  # the store's host has gone
                reason = "its address is in the rendezvous store, which no longer answers"
                raise PeerUnavailableError(str(who), f"{reason} ({first_line(exc)})") from exc
        if rank is None:
            raise UnknownWorkerError(to, tuple(self.ranks_by_name))
        return rank

    def destination(self, to: object) -> str | int:
        """The name or rank ``to`` stands for.

        Raises:
            BadDestinationError: ``to`` is not a name, a rank or a worker info.
        """
        if isinstance(to, WorkerInfo):
            return to.name
        if isinstance(to, str) or (isinstance(to, int) and not isinstance(to, bool)):
            return to
        name = getattr(to, "name", None)  # torch's WorkerInfo
        if not isinstance(name, str):
            raise BadDestinationError(to, tuple(self.ranks_by_name))
        return name

    def worker_info(self, rank: int) -> WorkerInfo:
        """Raises: UnknownWorkerError: no worker has ``rank`` (dynamic: none in the store)."""
        if rank not in self.addresses and self.lookup(rank) is None:
            raise UnknownWorkerError(rank, tuple(self.ranks_by_name))
        return WorkerInfo(self.addresses[rank].name, rank)

    def worker_infos(self, may_block: bool) -> list[WorkerInfo]:
        """The group's members by rank. Static group: those not met yet are read in the
        store, in one request. Dynamic group: read in the store when ``may_block`` (off the
        loop thread), else the members this worker knows."""
        group = self._group
        if group is not None and group.world_size is not None:
            unknown = [r for r in range(group.world_size) if r not in self.addresses]
            try:
                for address in group.find_all(unknown):
                    self.learn(address)
            except (RuntimeError, OSError) as exc:  # the store's host has gone
                raise UnknownWorkerError(unknown[0], tuple(self.ranks_by_name)) from exc
            return [self.worker_info(r) for r in range(group.world_size)]
        ranks = self.current() if self.dynamic and may_block else sorted(dict(self.addresses))
        return [self.worker_info(r) for r in ranks]
