"""Unit tests of the rendezvous's store requests (``runtime/group/rendezvous.py`` and
``barriers.py``) over an in-memory store (torch's HashStore, threads for members): a static
member joins and passes a barrier in a fixed number of requests whatever the group's
size, errors reach every member, and addresses are read when first needed."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from asyncrpc.errors import (
    DuplicateRankError,
    PeerUnavailableError,
    RendezvousTimeoutError,
    UnknownWorkerError,
    WorldSizeMismatchError,
)
from asyncrpc.runtime.group import rendezvous
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.group.rendezvous import PeerAddress, StoreGroup

pytestmark = pytest.mark.timeout(60)


class _Counted:
    """A store whose requests are counted (one counter per member)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, Counter[str]()
        self.keys_named: list[int] = []  # how many keys each check named
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            with self._lock:
                self.requests[name] += 1
                if name == "check":
                    self.keys_named.append(len(args[0]))
            return method(*args)

        return counted

    @property
    def total(self) -> int:
        return sum(self.requests.values())


def _address(rank: int) -> PeerAddress:
    return PeerAddress(f"w{rank}", rank, "127.0.0.1", 20000 + rank)


def _join_all(
    store: Any, size: int, ranks: list[int] | None = None, timeout: float = 20.0,
    sizes: dict[int, int] | None = None,
) -> tuple[list[StoreGroup], list[_Counted], list[Any]]:  # fmt: skip
    """Join ``ranks`` (default: all) of a static group of ``size`` on threads; their
    groups, counted stores, and outcomes (the key, or the exception)."""
    ranks = list(range(size)) if ranks is None else ranks
    counted = [_Counted(store) for _ in ranks]
    groups = [
        StoreGroup(c, r, (sizes or {}).get(r, size)) for c, r in zip(counted, ranks, strict=True)
    ]

    def join(group: StoreGroup) -> Any:
        try:
            return rendezvous._join_store(group, _address(group.rank), None, timeout)[1]
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(ranks)) as pool:
        outcomes = list(pool.map(join, groups))
    return groups, counted, outcomes


@pytest.mark.parametrize("size", [8, 64])
def test_static_join_costs_each_member_at_most_ten_requests(size: int) -> None:
    groups, counted, keys = _join_all(dist.HashStore(), size)
    assert all(isinstance(k, bytes) for k in keys), keys
    assert len(set(keys)) == 1  # rank 0's key, read by all in the gate
    assert max(c.total for c in counted) <= 10, [dict(c.requests) for c in counted]
    assert sum(c.requests["get"] for c in counted) <= size  # no member reads every address
    assert {g.host_name for g in groups} == {"w0"}


def test_every_member_learns_rank_0s_address_from_the_gate() -> None:
    # Rank 0's process may end (its store with it) right after init: its address is the
    # one a member must know without a look-up.
    store = dist.HashStore()
    results: dict[int, Any] = {}

    def join(rank: int) -> None:
        group = StoreGroup(store, rank, 3)
        results[rank] = rendezvous._join_store(group, _address(rank), None, 20.0)[0]

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(join, range(3)))
    assert all(known == {0: _address(0)} for known in results.values()), results


class _GoneStore:
    """A store whose host has died: every request fails as torch's DistNetworkError does."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_member_not_met_when_the_store_is_gone_is_unavailable_not_unknown() -> None:
    directory = Directory({1: _address(1)}, StoreGroup(_GoneStore(), 1, 4))
    with pytest.raises(PeerUnavailableError, match="rendezvous store"):
        directory.resolve("w3")
    with pytest.raises(UnknownWorkerError):
        directory.resolve(9)  # outside the group: no store needed to say so


def test_static_member_reads_an_address_when_first_needed() -> None:
    groups, counted, _ = _join_all(dist.HashStore(), 6)
    directory = Directory({3: _address(3)}, groups[3])
    before = counted[3].total
    assert directory.resolve("w5") == 5  # a name: its rank, then its address
    assert directory.addresses[5] == _address(5)
    assert directory.resolve(5) == 5  # known now: no request
    assert directory.resolve(1) == 1
    assert counted[3].total - before == 4  # a name: check and get, then the rank's get
    with pytest.raises(UnknownWorkerError):
        directory.resolve(6)  # outside the group: refused without a request
    infos = directory.worker_infos(may_block=False)
    assert [i.name for i in infos] == [f"w{r}" for r in range(6)]
    assert counted[3].requests["multi_get"] == 1  # the rest in one request


def test_duplicate_rank_reaches_every_member_at_once() -> None:
    store = dist.HashStore()
    # Rank 2 never comes, so the group cannot form before the duplicate is seen: every
    # member raises the posted error, none waits out the timeout (then the error would
    # be a RendezvousTimeoutError).
    _, _, outcomes = _join_all(store, 3, ranks=[0, 1, 1], timeout=30.0)
    errors = [o for o in outcomes if isinstance(o, DuplicateRankError)]
    assert len(errors) == 3, outcomes


def test_world_size_mismatch_is_posted_for_all() -> None:
    _, _, outcomes = _join_all(dist.HashStore(), 3, sizes={2: 4}, timeout=30.0)
    assert all(isinstance(o, WorldSizeMismatchError) for o in outcomes), outcomes


def test_a_missing_rank_is_named_on_every_member() -> None:
    _, _, outcomes = _join_all(dist.HashStore(), 4, ranks=[0, 1, 2], timeout=0.5)
    assert all(isinstance(o, RendezvousTimeoutError) for o in outcomes), outcomes
    assert all("3" in str(o) for o in outcomes)


@pytest.mark.parametrize("size", [8, 64, 200])
def test_a_barrier_costs_an_add_and_one_worker_knows_it_completed_it(size: int) -> None:
    # An arrival is one add (its rank's bit); the arrival that fills a block of 62 adds
    # one to the count of full blocks, and the one that fills the last block sets the
    # "open" key and is the only one to know it opened the barrier (it tells the others
    # over peer connections: shutdown.py). Here nobody tells: the others poll the one key.
    store = dist.HashStore()
    groups = [StoreGroup(_Counted(store), r, size) for r in range(size)]
    gate = threading.Barrier(size)

    def pass_barrier(group: StoreGroup) -> bool:
        gate.wait()
        group.reach("closing")
        return group.await_arrivals("closing", list(range(size)), 10.0)

    with ThreadPoolExecutor(size) as pool:
        assert all(pool.map(pass_barrier, groups))
    blocks = (size + 61) // 62
    assert sum(g.store.inner.requests["add"] for g in groups) == size + blocks
    assert sum(g.store.inner.requests["set"] for g in groups) == 1
    assert sum("closing" in g.opened_here for g in groups) == 1
    named = {n for g in groups for n in g.store.inner.keys_named}
    assert named == {1}, named  # a poll names one key, whatever the size


def test_the_last_arrival_opens_the_barrier_and_costs_two_more_requests() -> None:
    store = dist.HashStore()
    size = 70  # two blocks
    groups = [StoreGroup(_Counted(store), r, size) for r in range(size)]
    for group in groups[:-1]:
        group.arrive("calls-done")
        assert group.opened_here == {}
    last = groups[-1]
    assert not last.await_arrivals("calls-done", list(range(size)), 0.0)
    before = last.store.inner.total
    last.arrive("calls-done")
    # Its add, the count of full blocks, the "open" key.
    assert last.store.inner.total - before == 3
    assert last.opened_here == {"calls-done": False}  # nobody was counted dead
    assert groups[0].await_arrivals("calls-done", list(range(size)), 0.0)


def test_a_dead_rank_is_counted_once_and_opens_the_barrier() -> None:
    store = dist.HashStore()
    size = 70  # two blocks
    groups = [StoreGroup(store, r, size) for r in range(size)]
    for group in groups:
        if group.rank not in (5, 64):
            group.arrive("closing")
    assert not groups[0].await_arrivals("closing", list(range(size)), 0.05)
    assert groups[0].missing("closing") == [5, 64]
    # Rank 64 dies; two survivors count it: once.
    assert groups[1].count_dead("closing", 64)
    assert not groups[2].count_dead("closing", 64)
    assert groups[0].missing("closing") == [5]
    # Rank 5 was thought dead but arrives: counted once, its bits not carried over.
    assert groups[3].count_dead("closing", 5)
    assert groups[3].opened_here == {"closing": True}  # its count filled the last block
    groups[5].arrive("closing")
    assert groups[5].opened_here == {}
    assert groups[0].missing("closing") == []
    assert groups[0].await_arrivals("closing", list(range(size)), 1.0)
    assert not groups[1].count_dead("closing", 63)  # arrived: not counted again
    # The others learn whom the first survivor declared dead (one request if none).
    assert groups[4].lost_ranks() == []
    groups[1].declare_lost(64)
    groups[2].declare_lost(64)
    assert groups[4].lost_ranks() == [64]


def test_missing_ranks_are_read_per_block() -> None:
    store = dist.HashStore()
    group = StoreGroup(_Counted(store), 0, 64)
    for rank in range(64):
        if rank != 37:
            StoreGroup(store, rank, 64).arrive("calls-done")
    counted = group.store.inner
    assert isinstance(counted, _Counted)
    assert not group.await_arrivals("calls-done", list(range(64)), 0.05)
    before = counted.total
    assert group.missing("calls-done", list(range(64))) == [37]
    assert counted.total - before == 2  # check and multi_get of the blocks, not per rank
    assert group.missing("calls-done", [1, 2, 3]) == []
