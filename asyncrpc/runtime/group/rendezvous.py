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
import datetime
import importlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import msgpack

from asyncrpc.errors import (
    DuplicateNameError,
    DuplicateRankError,
    InitError,
    MissingRankError,
    MixedGroupError,
    RendezvousTimeoutError,
    ShutdownError,
    StoreHostLostError,
    WorldSizeMismatchError,
)
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.runtime.group.quiet import QuietStore, quiet_cpp_logs

__all__ = ["MIXED_GROUP", "PeerAddress", "StoreGroup", "is_dynamic", "join_group"]

_log = logging.getLogger(__name__)
_PREFIX = "asyncrpc/"
_T = TypeVar("_T")
_POLL_S = 0.01
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


def this_host_id() -> str:
    """Boot id and host name: equal for processes of one running kernel and host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "?"
    return f"{boot_id}/{socket.gethostname()}"


def is_dynamic(init_method: str, world_size: int | None) -> bool:
    """Whether a worker joining with these arguments makes (or joins) a dynamic group.

    No ``world_size`` means dynamic, as in torch, except with ``env://`` where ``WORLD_SIZE``
    is set: that size is read, and the group is static (asyncrpc's choice: a torchrun job
    gets the static group's all-together shutdown without passing ``world_size``).
    """
    if world_size is not None:
        return False
    return not (init_method.startswith("env://") and "WORLD_SIZE" in os.environ)


def check_rank(init_method: str, rank: int) -> None:
    """Refuse a missing rank the way torch's rendezvous does (a ``ValueError``, its words).

    Raises:
        MissingRankError: ``rank`` is negative and the init method cannot supply one.
    """
    if rank >= 0:
        return
    scheme = init_method.partition("://")[0]
    if scheme == "env":
        if not os.environ.get("RANK"):
            raise MissingRankError(
                "env:// rendezvous: environment variable RANK expected, but not set"
            )
    elif scheme in ("file", "tcp"):
        raise MissingRankError(f"{scheme}:// rendezvous: rank parameter missing")


def _open_store(
    init_method: str, rank: int, world_size: int | None, timeout: float, host: str = ""
) -> Any:
    # Connecting to a store nobody serves yet logs each attempt in C++, with its stack:
    # the InitError raised says the same in one line (see quiet.py).
    with quiet_cpp_logs():
        return _open_store_loudly(init_method, rank, world_size, timeout, host)


def _open_store_loudly(
    init_method: str, rank: int, world_size: int | None, timeout: float, host: str
) -> Any:
    # The module (``torch.distributed.rendezvous`` the attribute is its function).
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    seconds = datetime.timedelta(seconds=timeout)
    try:
        if world_size is None and is_dynamic(init_method, world_size):
            # The public rendezvous() cannot say "no world size" (-1 there means "read it
            # from the URL or the environment"); torch's init_rpc opens the store of a
            # dynamic group through this helper, and so do we.
            opened = torch_rendezvous._rendezvous_helper(init_method, rank, None, timeout=seconds)
        elif init_method.startswith(("tcp://", "env://")):
            # A TCPStore given a world size makes its host (rank 0) wait in its constructor
            # until that many clients have connected: a member started with a smaller
            # world_size leaves it stuck there, unable to say why, until the timeout. Opened
            # with none (-1), the sizes are compared in the store instead (claim_size).
            url, rank, size = _sizeless_url(init_method, rank, world_size)
            if init_method.startswith("env://") and _under_agent_store():
                return _elastic_store(rank, host, timeout), rank, size
            opened = torch_rendezvous._rendezvous_helper(url, -1, -1, timeout=seconds)
            store, rank_out, _ = next(opened)
            return store, int(rank_out), size
        else:
            opened = torch_rendezvous.rendezvous(
                init_method,
                rank=rank,
                world_size=-1 if world_size is None else world_size,
                timeout=seconds,
            )
        store, rank_out, world_out = next(opened)
    except (ValueError, RuntimeError, OSError) as exc:
        hint = ""
        if _hosts_store(init_method) and rank != 0 and isinstance(exc, (RuntimeError, OSError)):
            hint = " (rank 0's process serves this store: has it started, at that address?)"
        raise InitError(
            f"rendezvous through {init_method!r} failed: {_first_line(exc)}{hint}"
        ) from exc
    return store, int(rank_out), int(world_out)


def _under_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_ELASTIC_KEY = _PREFIX + "elastic_store"


def _elastic_store(rank: int, host: str, timeout: float) -> Any:
    # Under torchrun the store at MASTER_ADDR:MASTER_PORT is the launcher's own, and it
    # outlives a restart of the group: keys from the attempt before (claimed ranks,
    # addresses of dead workers) would be read as this attempt's. So rank 0 hosts a fresh
    # store for each attempt and posts its address in the launcher's (the address rank 0
    # advertises for RPC, which the others must reach anyway; MASTER_ADDR if that is a
    # wildcard); the others dial what is posted until it answers (a post from the attempt
    # before names a store that died with its rank 0). Bounded by the rendezvous timeout.
    tcp_store = importlib.import_module("torch.distributed").TCPStore
    seconds = datetime.timedelta(seconds=timeout)
    agent = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=seconds)  # fmt: skip
    if rank == 0:
        where = os.environ["MASTER_ADDR"] if host in ("", "0.0.0.0", "::") else host
        own = tcp_store(where, 0, is_master=True, timeout=seconds, wait_for_workers=False,
                        multi_tenant=True)  # fmt: skip
        agent.set(_ELASTIC_KEY, f"{where} {own.port}")
        return own
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        where, port = agent.get(_ELASTIC_KEY).decode().split()
        if _answers(where, int(port)):  # a plain probe first: a dead store fails quietly
            with contextlib.suppress(RuntimeError, OSError):  # it died since the probe
                return tcp_store(where, int(port), is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=5.0))  # fmt: skip
        if time.monotonic() > deadline:
            raise InitError(f"no store of this attempt answered at {where}:{port} in time")
        time.sleep(0.2)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _sizeless_url(init_method: str, rank: int, world_size: int | None) -> tuple[str, int, int]:
    """``init_method`` with this rank and world size -1 in its query, for torch's handler;
    the rank and the world size it stands for (argument, URL query, or ``env://``'s
    ``RANK`` and ``WORLD_SIZE``, in torch's order)."""
    parts = urlparse(init_method)
    query = dict(parse_qsl(parts.query))
    if rank < 0:
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
    if world_size is None:
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    if world_size < 1:
        raise InitError(f"{init_method}: no world size (pass world_size or set WORLD_SIZE)")
    query.update(rank=str(rank), world_size="-1")
    return urlunparse(parts._replace(query=urlencode(query))), rank, world_size


def _first_line(exc: BaseException) -> str:
    # torch's store errors carry a C++ stack after their first line: the cause stays
    # chained, the message keeps the sentence.
    return str(exc).strip().partition("\n")[0]


def _pack(address: PeerAddress) -> bytes:
    return bytes(
        msgpack.packb(
            [address.name, address.rank, address.host, address.port, address.device_maps,
             address.host_id, address.unix_path, address.lane_port, address.lane_path]
        )
    )  # fmt: skip


def _unpack(record: bytes) -> PeerAddress:
    name, rank, host, port, maps, host_id, unix_path, lane_port, lane_path = msgpack.unpackb(record)
    return PeerAddress(name, rank, host, port, maps, host_id, unix_path, lane_port, lane_path)


class StoreGroup:
    """The store of a worker group, with the keys asyncrpc keeps in it."""

    def __init__(self, store: Any, rank: int, world_size: int | None) -> None:
        # Every call through it is quiet in C++: a store whose host has gone would log
        # its failure with a C++ stack before raising it (see quiet.py).
        self.store = store if isinstance(store, QuietStore) else QuietStore(store)
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
        """Record the group's kind (static or dynamic), or check it against the first's.

        Raises:
            MixedGroupError: the group's members joined as the other kind.
        """
        kind = "dynamic" if self.dynamic else "static"
        current = self.store.compare_set(_PREFIX + "kind", "", kind)
        if current != kind.encode():
            raise MixedGroupError(MIXED_GROUP)

    def enter(self) -> None:
        """Count this worker among those that reached the store, then fail at once with the
        error another member posted, if one did (see ``linger``)."""
        self.store.add(_PREFIX + "entered", 1)
        self.check_aborted()

    def claim_size(self) -> None:
        """Static: record this world size, or check it against the first member's.

        Called before publishing the address, so nobody can finish joining (which needs
        every address) while a member with another size exists.

        Raises:
            WorldSizeMismatchError: another member was started with another world size
                (posted for the others too).
        """
        if self.world_size is None:
            return
        mine = f"{self.world_size} {self.rank}"
        current = self.store.compare_set(_PREFIX + "world_size", "", mine).decode()
        size, rank = (int(part) for part in current.split())
        if size != self.world_size:
            raise self._post(WorldSizeMismatchError(self.rank, self.world_size, rank, size))

    def _claim(self, key: str, value: str) -> str | None:
        """Claim ``key``; None if it is ours, else the value the holder wrote."""
        current = self.store.compare_set(_PREFIX + key, "", value).decode()
        return None if current == value else str(current)

    def _post(self, error: InitError) -> InitError:
        """Static group: post ``error`` for the members still joining; return it to raise."""
        if self.world_size is not None:
            self.store.set(_PREFIX + "abort", msgpack.packb([type(error).__name__, error.args]))
            self.store.add(_PREFIX + "abort_seen", 1)
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

    def publish(self, address: PeerAddress, share_key: bool = False) -> None:
        """Claim this worker's rank and name, then publish its address.

        With ``share_key`` (rank 0, when no key is configured) a random group key is
        published first, so it is there before anyone can have gathered every address.
        A dynamic member then lists itself among the members (after its address: a listed
        member can always be read).

        Raises:
            DuplicateRankError: another worker holds this rank (posted for the others).
            DuplicateNameError: another worker holds this name (posted for the others).
        """
        if share_key:
            self.store.set(_PREFIX + "auth_key", auth.new_key())
        # The rank's claim names its holder (a unique suffix tells two same-named apart).
        holder = self._claim(f"rank/{address.rank}", f"{address.name} {uuid.uuid4().hex}")
        if holder is not None:
            other = holder.split()[0]
            raise self._post(DuplicateRankError(address.rank, address.name, other))
        holder = self._claim(f"name/{address.name}", str(address.rank))
        if holder is not None:
            raise self._post(DuplicateNameError(address.name, address.rank, int(holder)))
        self.store.set(f"{_PREFIX}worker/{address.rank}", _pack(address))
        if self.dynamic:
            number = int(self.store.add(_PREFIX + "members", 1))
            self.store.set(f"{_PREFIX}member/{number}", str(address.rank))

    def gather(self, timeout: float) -> dict[int, PeerAddress]:
        """Static: wait until every rank has published, then return all addresses by rank.
        Dynamic: the members there now (never waits)."""
        if self.world_size is None:
            return {r: a for r in self.member_ranks() if (a := self.find(r)) is not None}
        keys = {r: f"{_PREFIX}worker/{r}" for r in range(self.world_size)}
        self._wait_for(keys, timeout, "joining the group")
        return {r: _unpack(self.store.get(key)) for r, key in keys.items()}

    def shared_key(self) -> bytes:
        """The group key rank 0 published (call after ``gather``)."""
        return bytes(self.store.get(_PREFIX + "auth_key"))

    def first_key(self) -> bytes:
        """Dynamic: the group key, made by whichever member asks first (no rank 0 needed)."""
        return bytes(self.store.compare_set(_PREFIX + "auth_key", "", auth.new_key()))

    # -- a dynamic group's members ---------------------------------------------------------
    # Reads here never wait for a key to appear (``check`` first, then ``get`` of a key that
    # is there): a lookup costs a few store round trips, never the store's timeout.

    def _get_if_set(self, key: str) -> bytes | None:
        """The value of ``key`` (under our prefix), or None if nobody set it yet."""
        key = _PREFIX + key
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def member_ranks(self) -> list[int]:
        """Ranks of the members listed so far, joined or left, in joining order."""
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
        record = self._get_if_set(f"worker/{who}")
        return None if record is None else _unpack(record)

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` has finished its shutdown (reached the "left" barrier)."""
        return bool(self.store.check([f"{_PREFIX}barrier/left/{rank}"]))

    def _wait_for(self, keys: dict[int, str], timeout: float, what: str) -> None:
        """Wait until every key (by rank) is set.

        Raises:
            RendezvousTimeoutError: some are still missing after ``timeout`` (posted for
                the others, so that every member names the missing ranks, not only the
                first to give up; rank 0 then keeps its store up until they have read it).
        """
        deadline = time.monotonic() + timeout
        # Bounded poll: check() never blocks, so an abort or the deadline is seen promptly.
        while not self.store.check(list(keys.values())):
            self.check_aborted()
            if time.monotonic() > deadline:
                missing = [r for r, key in keys.items() if not self.store.check([key])]
                assert self.world_size is not None  # only a static group waits
                raise self._post(
                    RendezvousTimeoutError(self.rank, self.world_size, timeout, missing, what)
                )
            time.sleep(_POLL_S)

    # -- barriers --------------------------------------------------------------------------

    def arrive(self, tag: str) -> None:
        """Mark this rank as having reached barrier ``tag``."""
        self.store.set(f"{_PREFIX}barrier/{tag}/{self.rank}", b"1")

    def reach(self, tag: str) -> None:
        """``arrive`` at a shutdown barrier.

        Raises:
            ShutdownError: the store is unreachable (naming the worker that served it).
        """
        self._store_op(lambda: self.arrive(tag))

    def wait_arrived(self, tag: str, timeout: float, what: str) -> None:
        """Static: wait until every rank has reached barrier ``tag`` (start-up only)."""
        assert self.world_size is not None
        keys = {r: f"{_PREFIX}barrier/{tag}/{r}" for r in range(self.world_size)}
        self._wait_for(keys, timeout, what)

    def declare_lost(self, rank: int) -> None:
        """Record that this worker found ``rank`` dead while shutting down."""
        self._store_op(lambda: self.store.set(f"{_PREFIX}lost/{rank}", b"1"))

    def declared_lost(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` some worker recorded as dead (never blocks)."""
        return self._store_op(
            lambda: [r for r in ranks if self.store.check([f"{_PREFIX}lost/{r}"])]
        )

    def missing(self, tag: str) -> list[int]:
        """Ranks that have not reached barrier ``tag`` yet (never blocks). In a dynamic
        group: the members listed now."""

        def read() -> list[int]:
            ranks = self.member_ranks() if self.world_size is None else range(self.world_size)
            keys = {r: f"{_PREFIX}barrier/{tag}/{r}" for r in ranks}
            if self.store.check(list(keys.values())):
                return []
            return [r for r, key in keys.items() if not self.store.check([key])]

        return self._store_op(read)

    def _store_op(self, op: Callable[[], _T]) -> _T:
        """Run a shutdown-time store operation; an unreachable store is a ShutdownError."""
        try:
            return op()
        except (RuntimeError, OSError) as exc:
            raise self.unreachable(exc) from exc

    def unreachable(self, exc: BaseException) -> ShutdownError:
        """The error of a store call that failed after start-up: naming the worker that
        served the store, when one did (its process has ended, or it closed the store)."""
        if self.host_name is None:
            return ShutdownError(f"the rendezvous store is unreachable: {_first_line(exc)}")
        return ShutdownError(
            f"worker {self.host_name!r} (rank 0) is gone: its process served the rendezvous "
            f"store, which no longer answers ({_first_line(exc)})"
        )


def _hosts_store(init_method: str) -> bool:
    """Whether rank 0's process hosts the store (a TCPStore: ``tcp://`` and ``env://``)."""
    return init_method.startswith(("tcp://", "env://"))


def _join_store(
    group: StoreGroup, address: PeerAddress, auth_key: bytes | None, timeout: float
) -> tuple[dict[int, PeerAddress], bytes]:
    """The store half of ``join_group``: claims, publication, peers; returns them and the key."""
    group.enter()
    group.claim_kind()
    if group.dynamic:
        key = auth_key if auth_key is not None else group.first_key()
        group.publish(address)
        return group.gather(timeout), key
    group.claim_size()
    group.publish(address, share_key=auth_key is None and group.rank == 0)
    peers = group.gather(timeout)
    key = auth_key if auth_key is not None else group.shared_key()
    # Rank 0 returns last, once every member has read all it needs: its program may end
    # right after init_rpc, and the store with it, without breaking anyone's start.
    group.arrive("joined")
    if group.rank == 0:
        group.wait_arrived("joined", timeout, "waiting for every member to finish joining")
    return peers, key


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
        The store group, every worker's address by rank (dynamic: the members there
        now), and the group key.

    Raises:
        MissingRankError: no rank given, and the init method has none.
        MixedGroupError: the group's members joined as the other kind (static, dynamic).
        InitError: bad arguments, duplicate name or rank, unreachable store, or timeout.
    """
    check_rank(init_method, rank)
    dynamic = is_dynamic(init_method, world_size)
    store, rank, world_out = _open_store(init_method, rank, world_size, timeout, host)
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
        if rank == 0 and type(exc) in _POSTED.values() and _hosts_store(init_method):
            # Exiting now would take the store, and the posted error, with it: the others
            # would only hear that the store is gone.
            with contextlib.suppress(RuntimeError, OSError):
                group.linger(min(timeout, _LINGER_S))
        raise
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError: the store host died
        if _hosts_store(init_method):
            raise StoreHostLostError(init_method, _first_line(exc)) from exc
        raise InitError(f"the rendezvous store became unreachable: {_first_line(exc)}") from exc
    peers[rank] = address
    if _hosts_store(init_method) and 0 in peers:
        group.host_name = peers[0].name
    _log.debug("worker %r (rank %d) joined a group of %s", name, rank, size or "any size")
    return group, peers, key
