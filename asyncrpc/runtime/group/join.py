"""Joining the group: the rendezvous, done while the listener parks what it accepts, and
``Group``, the frozen description of the group it returns (layer L2.3).

Everything the agent's parts need to know of the group exists once ``join`` returns, so
they are built from a ``Group`` and none of them starts half-made.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from asyncrpc.errors import InitError
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.group.rendezvous import StoreGroup, join_group
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.tls import TlsContexts

__all__ = ["Group", "join", "raise_open_files_limit"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Group:
    """The group as this worker joined it.

    Attributes:
        name, rank: this worker's.
        world_size: the number of workers; None for a dynamic group (members come and go).
        addresses: every known member's address by rank. The one mutable part: members
            are added (by ``directory``) when first met, in any group (a static group's
            addresses are read when first needed); none is removed.
        key: the group key each connection's handshake proves.
        tls: mutual TLS for every connection; None without.
        directory: who is in the group, and how to find newcomers in the store.
        store: the rendezvous store (barriers, leaving).
    """

    name: str
    rank: int
    world_size: int | None
    addresses: dict[int, PeerAddress]
    key: bytes
    tls: TlsContexts | None
    directory: Directory
    store: StoreGroup

    @property
    def dynamic(self) -> bool:
        return self.world_size is None

    @property
    def lazy(self) -> bool:
        """Whether members not met yet are read in the store (see ``Directory.lazy``)."""
        return self.directory.lazy

    @property
    def host_id(self) -> str | None:
        """This host's identity when peers on it may dial the Unix socket, else None."""
        mine = self.addresses[self.rank]
        return mine.host_id if mine.unix_path else None

    def same_host(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host, where memory may be shared (never over TLS)."""
        address, mine = self.addresses.get(rank), self.addresses[self.rank]
        return (
            self.tls is None
            and sys.platform == "linux"
            and rank != self.rank
            and address is not None
            and bool(address.host_id)
            and address.host_id == mine.host_id
        )

    async def lookup(self, rank: int) -> None:
        """Learn ``rank``'s address if it is a member not met yet (off the loop)."""
        await self.directory.lookup_async(rank)


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit of open files to its hard limit; the limits before.

    A worker holds one descriptor per peer it talks to, and one or two to the store: in a
    group of a thousand whose members all talk to each other, more than the usual soft
    limit of 1,024. Raising it up to the hard limit needs no privilege. None where the
    platform has no such limits (Windows) or it cannot be changed.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses an unlimited soft limit for open files: then a large finite one.
    target = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            _log.debug("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
            return None
        _log.debug("open-files limit raised from %d to %d", soft, target)
    return soft, hard


async def join(
    name: str,
    rank: int,
    world_size: int | None,
    options: RpcBackendOptions,
    listener: Listener,
    tls: TlsContexts | None,
    lanes: tuple[int | None, str | None] = (None, None),
) -> Group:
    """Rendezvous (on a helper thread, so the loop keeps serving) and describe the group.

    ``lanes`` is where this worker takes lanes (a TCP port, an abstract Unix path), to
    publish with its address; a port is not published behind ``advertise_host`` or
    ``advertise_port`` (a NAT or proxy maps only the main port).

    Cancelling it stops waiting; the rendezvous thread runs on until its own timeout.

    Raises:
        InitError: bad arguments, duplicates, an unreachable store, or a timeout.
    """
    init_timeout = options.rpc_timeout if options.rpc_timeout > 0 else 300.0
    raise_open_files_limit()
    try:
        configured_key = auth.key_bytes(options.auth_key)
    except ValueError as exc:
        raise InitError(str(exc)) from None
    store, addresses, key = await asyncio.get_running_loop().run_in_executor(
        None,
        join_group,
        options.init_method,
        name,
        rank,
        world_size,
        options.advertise_host or options.listen_host,
        options.advertise_port or listener.port,
        init_timeout,
        options.device_maps,
        configured_key,
        listener.unix_path,
        None if options.advertise_host or options.advertise_port else lanes[0],
        lanes[1],
    )
    directory = Directory(addresses, store)
    return Group(name, store.rank, store.world_size, addresses, key, tls, directory, store)
