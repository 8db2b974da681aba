"""Rendezvous through torch's own machinery (TCPStore / FileStore), and store barriers (L2).

Every worker claims its rank and name in the store, publishes its listening address, and
reads everyone else's. Duplicate names or ranks and differing world sizes fail at init: the
first worker to see one posts the typed error in the store, and every member still joining
raises the same error at once instead of waiting out the timeout. So does a static group
whose members did not all come in time: the first to give up posts which ranks are
missing. All calls here block; the agent runs them on a helper thread so its loop keeps
serving.

A group is static (``world_size`` given: everyone waits for everyone) or dynamic (no
``world_size``: a member joins at once, reads the members already there, and is found by
later ones in the store when they first need it); the first member's kind is claimed in the
store and a member of the other kind is refused. A dynamic member also lists itself under a
sequence number, so that the members of the moment can be read back (``members``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, TypeVar

import msgpack

from asyncrpc.errors import (
    DuplicateNameError,
    DuplicateRankError,
    InitError,
    MixedGroupError,
    RendezvousTimeoutError,
    StoreHostLostError,
    WorldSizeMismatchError,
)
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.runtime.group import endpoints
from asyncrpc.runtime.group.barriers import StoreBarriers
from asyncrpc.runtime.group.quiet import QuietStore
from asyncrpc.runtime.group.stores import (
    check_rank,
    first_line,
    hosts_store,
    is_dynamic,
    open_store,
    this_host_id,
)

__all__ = ["MIXED_GROUP", "PeerAddress", "StoreGroup", "is_dynamic", "join_group"]

_log = logging.getLogger(__name__)
_PREFIX = "asyncrpc/"
_T = TypeVar("_T")
_POLL_S = 0.01
# What a gate holds when a member posted an error instead of letting the others on.
_ABORTED = b"\x00aborted"
# How long rank 0, whose process hosts a TCPStore, keeps it up after a failed start, for
# the other members to read why (they acknowledge it); bounded, as they may never come.
_LINGER_S = 5.0
# Errors a member posts in the store for the others to raise too: by class name, with their
# arguments (msgpack, never pickle: whoever reaches the store can write to it).
_POSTED: dict[str, type[InitError]] = {
    cls.__name__: cls
    for cls in (
        WorldSizeMismatchError,
        DuplicateNameError,
        DuplicateRankError,
        RendezvousTimeoutError,
    )
}
# torch's sentence for a group whose members disagree on being static or dynamic.
MIXED_GROUP = (
    "RPC group mixes statically and dynamically initialized members which is not supported."
)


def _pack(address: PeerAddress) -> bytes:
    # The claim of a rank holds its address, and a nonce: two workers started with the
    # same name, rank and advertised address still tell their claims apart.
    return bytes(
        msgpack.packb(
            [address.name, address.rank, address.host, address.port, address.device_maps,
             address.host_id, address.unix_path, address.lane_port, address.lane_path,
             uuid.uuid4().hex]
        )
    )  # fmt: skip


def _unpack(record: bytes) -> PeerAddress:
    name, rank, host, port, maps, host_id, unix_path, lane_port, lane_path, _ = msgpack.unpackb(
        record
    )
    return PeerAddress(name, rank, host, port, maps, host_id, unix_path, lane_port, lane_path)


class StoreGroup(StoreBarriers):
    """The store of a worker group, with the keys asyncrpc keeps in it.

    Joining a static group costs each member a fixed number of store requests, whatever
    the group's size: claims, one counter, and two waits the store answers when a key is
    set (no polling). Addresses are read when first needed (``find``), one request each.
    """

    def __init__(self, store: Any, rank: int, world_size: int | None) -> None:
        # Every call through it is quiet in C++: a store whose host has gone would log
        # its failure with a C++ stack before raising it (see quiet.py).
        super().__init__(store if isinstance(store, QuietStore) else QuietStore(store))
        self.rank = rank
        self.world_size = world_size  # None: a dynamic group
        # The worker whose process serves the store (rank 0 with tcp:// and env://), once
        # known: errors of a store gone away name it.
        self.host_name: str | None = None

    @property
    def dynamic(self) -> bool:
        return self.world_size is None

    # -- joining ---------------------------------------------------------------------------

    def claim_kind(self) -> None:
        """Record the group's kind (static with its size, or dynamic), or check it against
        the first member's: one request.

        Raises:
            MixedGroupError: the group's members joined as the other kind.
            WorldSizeMismatchError: a static member was started with another world size
                (posted for the others too).
        """
        mine = "dynamic" if self.world_size is None else f"static {self.world_size} {self.rank}"
        current = self.store.compare_set(_PREFIX + "kind", "", mine).decode()
        if current == mine:
            return
        kind, _, claim = current.partition(" ")
        if (kind == "dynamic") != self.dynamic:
            raise MixedGroupError(MIXED_GROUP)
        if self.world_size is not None:
            size, rank = (int(part) for part in claim.split())
            if size != self.world_size:
                raise self._post(WorldSizeMismatchError(self.rank, self.world_size, rank, size))

    def enter(self) -> None:
        """Count this worker among those that reached the store (see ``linger``)."""
        self.store.add(_PREFIX + "entered", 1)

    def _post(self, error: InitError) -> InitError:
        """Static group: post ``error`` for the members still joining, and wake those
        waiting (the gates they wait on are set to say so); return it to raise."""
        if self.world_size is not None:
            self.store.set(_PREFIX + "abort", msgpack.packb([type(error).__name__, error.args]))
            self.store.add(_PREFIX + "abort_seen", 1)
            self.store.compare_set(_PREFIX + "open", "", _ABORTED)
            self.store.compare_set(_PREFIX + "published_all", "", _ABORTED)
            self.store.compare_set(_PREFIX + "joined_all", "", _ABORTED)
        return error

    def check_aborted(self) -> None:
        """Raise the error a member posted (acknowledged, so that rank 0 may stop lingering)."""
        record = self._get_if_set("abort")
        if record is None:
            return
        self.store.add(_PREFIX + "abort_seen", 1)
        kind, args = msgpack.unpackb(record)
        cls = _POSTED.get(kind)
        raise cls(*args) if cls is not None else InitError(f"the group was aborted: {args}")

    def linger(self, timeout: float) -> None:
        """Rank 0 after a failed start: keep the store (its process hosts a TCPStore) up
        until every member that reached it has read the posted error, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # bounded: members that never read it
            seen = int(self.store.add(_PREFIX + "abort_seen", 0))
            if seen >= int(self.store.add(_PREFIX + "entered", 0)):
                return
            time.sleep(_POLL_S)

    def publish(self, address: PeerAddress) -> None:
        """Claim this worker's rank (the claim holds its address) and name.

        A static member is then counted; the last one opens the way for rank 0. A dynamic
        member lists itself among the members (after its address: a listed member can
        always be read).

        Raises:
            DuplicateRankError: another worker holds this rank (posted for the others).
            DuplicateNameError: another worker holds this name (posted for the others).
        """
        record = _pack(address)
        holder = self.store.compare_set(f"{_PREFIX}rank/{address.rank}", "", record)
        if holder != record:
            other = _unpack(holder).name
            raise self._post(DuplicateRankError(address.rank, address.name, other))
        claimed = self._claim(f"name/{address.name}", str(address.rank))
        if claimed is not None:
            raise self._post(DuplicateNameError(address.name, address.rank, int(claimed)))
        if self.world_size is not None:
            if int(self.store.add(_PREFIX + "published", 1)) == self.world_size:
                self.store.compare_set(_PREFIX + "published_all", "", b"1")
        else:
            number = int(self.store.add(_PREFIX + "members", 1))
            self.store.set(f"{_PREFIX}member/{number}", str(address.rank))

    def _claim(self, key: str, value: str) -> str | None:
        """Claim ``key``; None if it is ours, else the value the holder wrote."""
        current = self.store.compare_set(_PREFIX + key, "", value).decode()
        return None if current == value else str(current)

    def open_gate(self, key: bytes, address: PeerAddress, timeout: float) -> None:
        """Rank 0 of a static group: once every member has published, let them all go on,
        with the group key and rank 0's address in the gate they wait on (one read for
        them; rank 0's address is the one a member needs even if rank 0, and its store,
        end right after init).

        Raises:
            RendezvousTimeoutError: members still missing after ``timeout`` (posted).
            The error another member posted.
        """
        # Not read: an error posted meanwhile also set the gate below, and the claim shows it.
        self._wait_gate("published_all", timeout, "joining the group", read=False)
        gate = bytes(msgpack.packb([key, _pack(address)]))
        if self.store.compare_set(_PREFIX + "open", "", gate) != gate:
            self.check_aborted()
            raise InitError("the group was aborted")  # its error's record was not readable

    def pass_gate(self, timeout: float) -> tuple[bytes, PeerAddress]:
        """A static member other than rank 0: wait until rank 0 opens the gate; the group
        key and rank 0's address.

        Raises:
            RendezvousTimeoutError: members still missing after ``timeout`` (posted).
            The error another member posted.
        """
        key, record = msgpack.unpackb(self._wait_gate("open", timeout, "joining the group"))
        return bytes(key), _unpack(record)

    def joined(self, timeout: float) -> None:
        """Mark this member as done with the store's start-up keys. Rank 0 waits for all of
        them: its program may end right after init_rpc, and the store with it."""
        assert self.world_size is not None
        if self.rank != 0:
            if int(self.store.add(_PREFIX + "joined", 1)) == self.world_size - 1:
                self.store.compare_set(_PREFIX + "joined_all", "", b"1")
        elif self.world_size > 1:
            what = "waiting for every member to finish joining"
            self._wait_gate("joined_all", timeout, what, counted="joined", read=False)

    def _wait_gate(
        self, key: str, timeout: float, what: str, counted: str = "", read: bool = True
    ) -> bytes:
        """Wait (one request: the store answers when the key is set) for gate ``key``, and
        read it (one more) unless ``read`` is False; its value.

        Raises:
            RendezvousTimeoutError: not set after ``timeout``; the ranks missing are named
                (posted, so that every member names them, not only the first to give up).
            The error another member posted, if the gate was set for that.
        """
        if not self.wait_for([_PREFIX + key], timeout):
            self.check_aborted()
            assert self.world_size is not None  # only a static group waits
            missing = self._unclaimed() if not counted else self._not_joined()
            raise self._post(
                RendezvousTimeoutError(self.rank, self.world_size, timeout, missing, what)
            )
        if not read:
            return b""
        value = self.store.get(_PREFIX + key)
        if value == _ABORTED:
            self.check_aborted()
            raise InitError("the group was aborted")  # its error's record was not readable
        return value

    def _unclaimed(self) -> list[int]:
        assert self.world_size is not None
        return self.unset({r: f"{_PREFIX}rank/{r}" for r in range(self.world_size)})

    def _not_joined(self) -> list[int]:
        # Joining is counted, not recorded by rank: name the ranks that never claimed one,
        # or all but rank 0 if every rank did (they are between publishing and joining).
        assert self.world_size is not None
        return self._unclaimed() or list(range(1, self.world_size))

    def first_key(self) -> bytes:
        """Dynamic: the group key, made by whichever member asks first (no rank 0 needed)."""
        return bytes(self.store.compare_set(_PREFIX + "auth_key", "", auth.new_key()))

    # -- looking members up ----------------------------------------------------------------
    # Reads here never wait for a key to appear (``check`` first, then ``get`` of a key that
    # is there): a lookup costs a few store round trips, never the store's timeout. In a
    # static group every rank has published before anyone's init returns: one ``get``.

    def _get_if_set(self, key: str) -> bytes | None:
        """The value of ``key`` (under our prefix), or None if nobody set it yet."""
        key = _PREFIX + key
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def member_ranks(self) -> list[int]:
        """Ranks of the members listed so far, joined or left, in joining order (static:
        every rank)."""
        if self.world_size is not None:
            return list(range(self.world_size))
        count = int(self.store.add(_PREFIX + "members", 0))
        listed = [self._get_if_set(f"member/{n}") for n in range(1, count + 1)]
        # A member counted but not yet listed is still joining: left out.
        return [int(rank) for rank in listed if rank is not None]

    def find(self, who: str | int) -> PeerAddress | None:
        """The published address of the worker named or ranked ``who``, None if none is."""
        if isinstance(who, str):
            rank = self._get_if_set(f"name/{who}")
            if rank is None:
                return None
            who = int(rank)
        if self.world_size is not None:
            if not 0 <= who < self.world_size:
                return None
            return _unpack(self.store.get(f"{_PREFIX}rank/{who}"))
        record = self._get_if_set(f"rank/{who}")
        return None if record is None else _unpack(record)

    def find_all(self, ranks: list[int]) -> list[PeerAddress]:
        """Static: the addresses of ``ranks`` (all published), in one request."""
        assert self.world_size is not None
        if not ranks:
            return []
        records = self.store.multi_get([f"{_PREFIX}rank/{r}" for r in ranks])
        return [_unpack(record) for record in records]


def _join_store(
    group: StoreGroup, address: PeerAddress, auth_key: bytes | None, timeout: float
) -> tuple[dict[int, PeerAddress], bytes]:
    """The store half of ``join_group``: claims, publication, the gate; returns the
    addresses known at once (static: rank 0's, from the gate) and the group key."""
    group.enter()
    group.claim_kind()
    if group.dynamic:
        key = auth_key if auth_key is not None else group.first_key()
        group.publish(address)
        members = group.member_ranks()
        return {r: a for r in members if (a := group.find(r)) is not None}, key
    group.publish(address)
    if group.rank == 0:
        key = auth_key if auth_key is not None else auth.new_key()
        group.open_gate(key if auth_key is None else b"", address, timeout)
        first = address
    else:
        shared, first = group.pass_gate(timeout)
        key = auth_key if auth_key is not None else shared
    group.host_name = first.name
    group.joined(timeout)
    return {0: first}, key


def _publish_metrics(group: StoreGroup, address: PeerAddress) -> None:
    """Publish the metrics endpoints this process serves (``endpoints.py``) for
    ``asyncrpc.top --rendezvous``. Best effort: a worker runs the same without it."""
    for host, port in endpoints.announced():
        endpoints.publish_or_log(group.store, address.rank, host, port, address.host)


def join_group(
    init_method: str,
    name: str,
    rank: int,
    world_size: int | None,
    host: str,
    port: int,
    timeout: float,
    device_maps: dict[str, dict[str, str]] | None = None,
    auth_key: bytes | None = None,
    unix_path: str | None = None,
    lane_port: int | None = None,
    lane_path: str | None = None,
) -> tuple[StoreGroup, dict[int, PeerAddress], bytes]:
    """Rendezvous, publish this worker and gather every peer's address (blocking).

    Args:
        init_method: ``env://``, ``tcp://host:port`` or ``file://path``.
        name: this worker's unique name.
        rank: this worker's rank, or -1 to read ``RANK`` from the environment.
        world_size: number of workers; None joins a dynamic group (``env://`` with
            ``WORLD_SIZE`` set: that size, a static group; see ``is_dynamic``).
        host: the address this worker listens on.
        port: the port this worker listens on.
        timeout: bound on the whole rendezvous, in seconds.
        device_maps: this worker's device maps, published for its callees.
        auth_key: the configured group key; None to share a random one through the store.
        unix_path: the Unix socket this worker also listens on, for peers on its host.
        lane_port, lane_path: where this worker takes lanes (``runtime/lanes/``), if it does.

    Returns:
        The store group, the addresses known now by rank (static: this worker's and rank
        0's, the others are read when first needed; dynamic: the members there now), and
        the group key.

    Raises:
        MissingRankError: no rank given, and the init method has none.
        MixedGroupError: the group's members joined as the other kind (static, dynamic).
        InitError: bad arguments, duplicate name or rank, unreachable store, or timeout.
    """
    check_rank(init_method, rank)
    dynamic = is_dynamic(init_method, world_size)
    store, rank, world_out = open_store(init_method, rank, world_size, timeout, host)
    size = None if dynamic else world_out
    if rank < 0 or (size is not None and rank >= size):
        raise InitError(f"rank {rank} is outside a world of size {size}")
    group = StoreGroup(store, rank, size)
    address = PeerAddress(
        name, rank, host, port, device_maps, this_host_id(), unix_path, lane_port, lane_path
    )
    try:
        peers, key = _join_store(group, address, auth_key, timeout)
    except InitError as exc:
        if rank == 0 and type(exc) in _POSTED.values() and hosts_store(init_method):
            # Exiting now would take the store, and the posted error, with it: the others
            # would only hear that the store is gone.
            with contextlib.suppress(RuntimeError, OSError):
                group.linger(min(timeout, _LINGER_S))
        raise
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError: the store host died
        if hosts_store(init_method):
            raise StoreHostLostError(init_method, first_line(exc)) from exc
        raise InitError(f"the rendezvous store became unreachable: {first_line(exc)}") from exc
    peers[rank] = address
    _publish_metrics(group, address)
    if not hosts_store(init_method):
        group.host_name = None  # rank 0's process does not serve this store
    elif 0 in peers:
        group.host_name = peers[0].name
    _log.debug("worker %r (rank %d) joined a group of %s", name, rank, size or "any size")
    return group, peers, key
