"""Rendezvous through torch's own machinery (TCPStore / FileStore), and store barriers (L2).

Every worker claims its rank and name in the store, publishes its listening address, and
reads everyone else's. Duplicate names or ranks fail at init, and the first worker to see
one posts an abort key so the rest fail fast instead of waiting out the timeout. All calls
here block; the agent runs them on a helper thread so its loop keeps serving.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack

from asyncrpc.errors import InitError, ShutdownError
from asyncrpc.protocol import auth

__all__ = ["PeerAddress", "StoreGroup", "join_group"]

_log = logging.getLogger("asyncrpc.runtime.rendezvous")
_PREFIX = "asyncrpc/"
_POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a worker listens."""

    name: str
    rank: int
    host: str
    port: int
    # This worker's CUDA device maps by callee name; callees invert them for replies.
    device_maps: dict[str, dict[str, str]] | None = None
    # Same host: the machine's identity (boot id and host name) and a Unix socket address
    # to try before TCP (None: the worker takes no Unix connections).
    host_id: str = ""
    unix_path: str | None = None


def this_host_id() -> str:
    """Boot id and host name: equal for processes of one running kernel and host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "?"
    return f"{boot_id}/{socket.gethostname()}"


def _open_store(init_method: str, rank: int, world_size: int | None, timeout: float) -> Any:
    from torch.distributed import rendezvous  # type: ignore[attr-defined]

    try:
        store, rank_out, world_out = next(
            rendezvous(
                init_method,
                rank=rank,
                world_size=-1 if world_size is None else world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise InitError(f"rendezvous through {init_method!r} failed: {exc}") from exc
    return store, int(rank_out), int(world_out)


class StoreGroup:
    """The store of a worker group, with the keys asyncrpc keeps in it."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    # -- joining ---------------------------------------------------------------------------

    def _claim(self, key: str, value: str, what: str) -> None:
        current = self.store.compare_set(_PREFIX + key, "", value)
        if current != value.encode():
            message = f"{what} is already taken by another worker: it is not unique"
            self.store.set(_PREFIX + "abort", message)
            raise InitError(message)

    def publish(self, address: PeerAddress, share_key: bool = False) -> None:
        """Claim this worker's rank and name, then publish its address.

        With ``share_key`` (rank 0, when no key is configured) a random group key is
        published first, so it is there before anyone can have gathered every address.
        """
        if share_key:
            self.store.set(_PREFIX + "auth_key", auth.new_key())
        self._claim(f"rank/{address.rank}", uuid.uuid4().hex, f"rank {address.rank}")
        self._claim(f"name/{address.name}", str(address.rank), f"worker name {address.name!r}")
        record = msgpack.packb(
            [address.name, address.rank, address.host, address.port, address.device_maps,
             address.host_id, address.unix_path]
        )  # fmt: skip
        self.store.set(f"{_PREFIX}worker/{address.rank}", record)

    def gather(self, timeout: float) -> dict[int, PeerAddress]:
        """Wait until every rank has published, then return all addresses by rank."""
        keys = [f"{_PREFIX}worker/{r}" for r in range(self.world_size)]
        self._wait_for(keys, timeout, "joining the group")
        peers = {}
        for key in keys:
            name, rank, host, port, maps, host_id, unix_path = msgpack.unpackb(self.store.get(key))
            peers[rank] = PeerAddress(name, rank, host, port, maps, host_id, unix_path)
        return peers

    def shared_key(self) -> bytes:
        """The group key rank 0 published (call after ``gather``)."""
        return bytes(self.store.get(_PREFIX + "auth_key"))

    def _aborted(self) -> str | None:
        if self.store.check([_PREFIX + "abort"]):
            return bytes(self.store.get(_PREFIX + "abort")).decode()
        return None

    def _wait_for(self, keys: list[str], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        # Bounded poll: check() never blocks, so an abort or the deadline is seen promptly.
        while not self.store.check(keys):
            reason = self._aborted()
            if reason is not None:
                raise InitError(f"the group was aborted while {what}: {reason}")
            if time.monotonic() > deadline:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self.store.check([k])]
                raise InitError(f"timed out after {timeout:g} s {what}; missing ranks {missing}")
            time.sleep(_POLL_S)

    # -- barriers --------------------------------------------------------------------------

    def arrive(self, tag: str) -> None:
        """Mark this rank as having reached barrier ``tag``."""
        self.store.set(f"{_PREFIX}barrier/{tag}/{self.rank}", b"1")

    def missing(self, tag: str) -> list[int]:
        """Ranks that have not reached barrier ``tag`` yet (never blocks)."""
        keys = [f"{_PREFIX}barrier/{tag}/{r}" for r in range(self.world_size)]
        try:
            if self.store.check(keys):
                return []
            return [r for r, key in enumerate(keys) if not self.store.check([key])]
        except (RuntimeError, OSError) as exc:
            raise ShutdownError(f"the rendezvous store is unreachable: {exc}") from exc


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
) -> tuple[StoreGroup, dict[int, PeerAddress], bytes]:
    """Rendezvous, publish this worker and gather every peer's address (blocking).

    Args:
        init_method: ``env://``, ``tcp://host:port`` or ``file://path``.
        name: this worker's unique name.
        rank: this worker's rank, or -1 to read ``RANK`` from the environment.
        world_size: number of workers, or None to read ``WORLD_SIZE``.
        host: the address this worker listens on.
        port: the port this worker listens on.
        timeout: bound on the whole rendezvous, in seconds.
        device_maps: this worker's device maps, published for its callees.
        auth_key: the configured group key; None to share a random one through the store.
        unix_path: the Unix socket this worker also listens on, for peers on its host.

    Returns:
        The store group, every worker's address by rank, and the group key.

    Raises:
        InitError: bad arguments, duplicate name or rank, unreachable store, or timeout.
    """
    if init_method.startswith("env://"):
        if rank < 0 and "RANK" not in os.environ:
            raise InitError("rank not given and RANK is not set for init_method='env://'")
        if world_size is None and "WORLD_SIZE" not in os.environ:
            raise InitError("world_size not given and WORLD_SIZE is not set for 'env://'")
    elif world_size is None or rank < 0:
        raise InitError(f"init_method {init_method!r} needs an explicit rank and world_size")
    store, rank, world_size = _open_store(init_method, rank, world_size, timeout)
    if not 0 <= rank < world_size:
        raise InitError(f"rank {rank} is outside a world of size {world_size}")
    group = StoreGroup(store, rank, world_size)
    try:
        address = PeerAddress(name, rank, host, port, device_maps, this_host_id(), unix_path)
        group.publish(address, share_key=auth_key is None and rank == 0)
        peers = group.gather(timeout)
        key = auth_key if auth_key is not None else group.shared_key()
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError: the store host died
        raise InitError(f"the rendezvous store became unreachable: {exc}") from exc
    _log.debug("worker %r (rank %d) joined a group of %d", name, rank, world_size)
    return group, peers, key
