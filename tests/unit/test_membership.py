"""Unit tests of group membership over an in-memory store (torch's HashStore, no I/O):
static or dynamic, torch's errors for a missing rank, a dynamic group's member list and
look-ups (``StoreGroup``, ``Directory``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from asyncrpc.errors import InitError, MissingRankError, MixedGroupError
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.group.rendezvous import MIXED_GROUP, PeerAddress, StoreGroup
from asyncrpc.runtime.group.stores import check_rank, is_dynamic


def _address(name: str, rank: int) -> PeerAddress:
    return PeerAddress(name, rank, "127.0.0.1", 1000 + rank)


def _dynamic_member(store: Any, name: str, rank: int) -> StoreGroup:
    group = StoreGroup(store, rank, None)
    group.claim_kind()
    group.publish(_address(name, rank))
    return group


@pytest.mark.parametrize("scheme", ["file:///tmp/x", "tcp://127.0.0.1:1"])
def test_check_rank_without_rank_raises_torchs_ValueError(scheme: str) -> None:
    with pytest.raises(MissingRankError, match="rank parameter missing") as caught:
        check_rank(scheme, -1)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, InitError)
    check_rank(scheme, 0)  # a rank given: nothing to say


def test_check_rank_env_reads_RANK(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(MissingRankError, match="environment variable RANK expected"):
        check_rank("env://", -1)
    monkeypatch.setenv("RANK", "3")
    check_rank("env://", -1)


def test_is_dynamic_without_world_size_unless_env_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert is_dynamic("file:///tmp/x", None)
    assert not is_dynamic("file:///tmp/x", 2)
    assert is_dynamic("env://", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_dynamic("env://", None)  # torchrun's size: a static group
    assert is_dynamic("tcp://127.0.0.1:1", None)


@pytest.mark.parametrize("first_static", [True, False])
def test_StoreGroup_refuses_a_member_of_the_other_kind(first_static: bool) -> None:
    store = dist.HashStore()
    StoreGroup(store, 0, 2 if first_static else None).claim_kind()
    StoreGroup(store, 2, 2 if first_static else None).claim_kind()  # same kind: welcome
    with pytest.raises(MixedGroupError) as caught:
        StoreGroup(store, 1, None if first_static else 2).claim_kind()
    assert isinstance(caught.value, RuntimeError)
    assert str(caught.value) == MIXED_GROUP


def test_StoreGroup_dynamic_members_are_listed_found_and_leave() -> None:
    store = dist.HashStore()
    a = _dynamic_member(store, "a", 0)
    assert a.member_ranks() == [0]
    b = _dynamic_member(store, "b", 5)  # any rank: no world size bounds it
    assert a.member_ranks() == [0, 5]
    assert a.find("b") == _address("b", 5) == a.find(5)
    assert a.find("nobody") is None
    assert a.find(7) is None
    assert b.find(0) == _address("a", 0)
    assert a.missing("left") == [0, 5]
    b.arrive("left")
    assert a.has_left(5)
    assert not a.has_left(0)
    assert a.missing("left") == [0]


def test_StoreGroup_dynamic_member_still_joining_is_not_listed() -> None:
    store = dist.HashStore()
    a = _dynamic_member(store, "a", 0)
    store.add("asyncrpc/members", 1)  # counted, not listed yet
    assert a.member_ranks() == [0]


def test_StoreGroup_first_key_is_the_first_members_for_everyone() -> None:
    store = dist.HashStore()
    first = StoreGroup(store, 3, None).first_key()
    assert len(first) >= 16
    assert StoreGroup(store, 0, None).first_key() == first


def test_Directory_looks_up_newcomers_once_and_leaves_out_those_that_left() -> None:
    store = dist.HashStore()
    a = _dynamic_member(store, "a", 0)
    directory = Directory({0: _address("a", 0)}, a)
    assert directory.dynamic
    assert directory.known("b") is None
    b = _dynamic_member(store, "b", 1)
    _dynamic_member(store, "c", 2)
    assert directory.lookup("b") == 1
    assert directory.known("b") == 1
    assert directory.addresses[1] == _address("b", 1)
    assert directory.lookup("nobody") is None
    b.arrive("left")
    assert directory.current() == [0, 2]  # c read in the store, b gone
    assert directory.known(2) == 2


class _GoneStore:
    """A store whose host has died: every call fails as torch's DistNetworkError does."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_Directory_lookup_without_a_store_says_unknown() -> None:
    directory = Directory({0: _address("a", 0)}, StoreGroup(_GoneStore(), 0, None))
    assert directory.lookup("b") is None
    assert directory.current() == [0]


def test_Directory_without_a_store_never_looks_up() -> None:
    directory = Directory({0: _address("a", 0), 1: _address("b", 1)}, None)
    assert not directory.dynamic
    assert directory.lookup("c") is None
    assert directory.current() == [0, 1]
    assert directory.known("b") == 1
    assert directory.known(1) == 1
    assert directory.known(2) is None
