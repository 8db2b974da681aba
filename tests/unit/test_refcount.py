"""Scripted scenarios of asyncrpc.protocol.refcount: RefCounters joined by an in-memory router."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrpc.errors import LocalProtocolError, RemoteProtocolError, RRefError, RRefOwnerLostError
from asyncrpc.protocol.refcount import RefCounter, UserState
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


class Router:
    """Workers 0..n-1; messages queue in send order until delivered."""

    def __init__(self, n: int = 4, **kwargs: int) -> None:
        self.rc = [RefCounter(rank, **kwargs) for rank in range(n)]
        self.queue: list[tuple[int, int, Message]] = []
        self.freed: list[RRefId] = []
        self.lost: list[tuple[int, RRefLost]] = []
        self.undone: list[tuple[int, RemoteUndelivered]] = []

    def apply(self, src: int, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(dest, message):
                    self.queue.append((src, dest, message))
                case Free(rref_id):
                    self.freed.append(rref_id)
                case RRefLost():
                    self.lost.append((src, action))
                case RemoteUndelivered():
                    self.undone.append((src, action))

    def deliver(self, index: int = 0, *, keep: bool = False) -> Message:
        src, dst, message = self.queue[index] if keep else self.queue.pop(index)
        self.apply(dst, self.rc[dst].on_message(src, message))
        return message

    def drain(self) -> None:
        while self.queue:
            self.deliver()

    def remote(self, caller: int, owner: int) -> tuple[RRefId, ForkId]:
        """remote(): the caller's fork, and the owner creating the value at once."""
        rref_id = self.rc[caller].next_rref_id()
        fork_id, actions = self.rc[caller].new_user(rref_id, owner)
        assert actions == []
        self.apply(owner, self.rc[owner].new_owner(rref_id, holder=caller, fork_id=fork_id))
        return rref_id, fork_id

    def pass_user(
        self, rref_id: RRefId, fork_id: ForkId, src: int, dest: int, owner: int = 0
    ) -> ForkId:
        """src pickles its user fork of owner's RRef for dest, which unpickles it at once."""
        child = self.rc[src].fork_from_user(rref_id, fork_id, dest)
        if dest == owner:
            self.apply(dest, self.rc[dest].received_own(rref_id, child, src))
        else:
            self.apply(dest, self.rc[dest].received_user(rref_id, child, owner, src))
        return child

    def settled(self, *dead: int) -> bool:
        return all(
            rc.quiescent() and rc.owner_leaks() == []
            for rank, rc in enumerate(self.rc)
            if rank not in dead
        )

    def kinds(self) -> list[type]:
        return [type(message) for _, _, message in self.queue]


def test_RefCounter_remote_then_drop_frees_value() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    assert net.queue == [(0, 1, ForkAccepted(rref_id, fork))]
    assert net.rc[1].user_state(fork) is UserState.UNCONFIRMED
    net.drain()
    assert net.rc[1].is_confirmed(fork)
    net.apply(1, net.rc[1].release_user(fork))
    assert net.queue == [(1, 0, UserDelete(rref_id, fork))]
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_chain_of_users_ends_empty() -> None:
    net = Router()
    rref_id, fork_a = net.remote(caller=1, owner=0)
    net.drain()
    fork_b = net.pass_user(rref_id, fork_a, src=1, dest=2)
    assert net.kinds() == [ForkRequest]
    fork_c = net.pass_user(rref_id, fork_b, src=2, dest=3)  # B forks before its confirmation
    for src, fork in ((1, fork_a), (2, fork_b), (3, fork_c)):
        net.apply(src, net.rc[src].release_user(fork))
    assert net.freed == []
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_owner_forks_to_user() -> None:
    net = Router()
    rref_id = net.rc[0].next_rref_id()
    assert net.rc[0].new_owner(rref_id) == []
    fork = net.rc[0].fork_from_owner(rref_id, 1)
    assert net.rc[1].received_user(rref_id, fork, owner=0, parent=0) == []
    assert net.rc[1].is_confirmed(fork)
    assert net.rc[0].drop_local_handle(rref_id) == []
    net.apply(1, net.rc[1].release_user(fork))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_user_sends_back_to_owner() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    child = net.pass_user(rref_id, fork, src=1, dest=0)
    assert net.queue == [(0, 1, ChildAccepted(rref_id, child))]
    net.apply(1, net.rc[1].release_user(fork))
    assert net.queue[1:] == []  # deferred: the child is still pending
    net.drain()
    assert net.freed == []  # the owner's local handle from received_own keeps it
    net.apply(0, net.rc[0].drop_local_handle(rref_id))
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_user_sends_home_without_a_fork() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    # Sent home before the confirmation arrived: the owner's entry exists already.
    assert net.rc[1].send_home(rref_id, fork) == 0
    assert net.rc[0].returned_home(rref_id) == []  # no ChildAccepted to wait for
    net.drain()
    net.apply(1, net.rc[1].release_user(fork))
    assert net.kinds() == [UserDelete]  # not deferred: no pending child
    net.drain()
    assert net.freed == []  # the owner's local handle keeps it
    net.apply(0, net.rc[0].drop_local_handle(rref_id))
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_send_home_refuses_unusable_forks_and_freed_values() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    net.apply(1, net.rc[1].release_user(fork))
    with pytest.raises(LocalProtocolError):
        net.rc[1].send_home(rref_id, fork)  # released
    net.drain()
    assert net.freed == [rref_id]
    # A late arrival at the owner after the value was freed: a dead handle, not a new entry.
    lost = net.rc[0].returned_home(rref_id)
    assert lost == [RRefLost(rref_id, 0)]
    assert net.settled()
    other, fork2 = net.remote(caller=2, owner=3)
    net.drain()
    net.apply(2, net.rc[2].peer_lost(3))
    with pytest.raises(RRefOwnerLostError):
        net.rc[2].send_home(other, fork2)


def test_RefCounter_release_before_confirmation_defers_delete() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    assert net.rc[1].release_user(fork) == []
    assert net.rc[1].user_state(fork) is UserState.RELEASED
    assert net.rc[1].debug_info()["pending_users"] == 1
    net.deliver()
    assert net.queue == [(1, 0, UserDelete(rref_id, fork))]
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_parent_release_waits_for_child_accepted() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    child = net.pass_user(rref_id, fork, src=1, dest=2)
    assert net.rc[1].release_user(fork) == []
    net.deliver()  # ForkRequest reaches the owner
    net.deliver()  # ForkAccepted reaches worker 2, which answers the parent
    assert net.queue == [(2, 1, ChildAccepted(rref_id, child))]
    net.deliver()
    assert net.queue == [(1, 0, UserDelete(rref_id, fork))]
    net.drain()
    assert net.freed == []  # the child still holds it
    net.apply(2, net.rc[2].release_user(child))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_duplicates_are_ignored() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.deliver(keep=True)
    net.deliver()  # duplicate ForkAccepted: no second effect
    net.drain()
    child = net.pass_user(rref_id, fork, src=1, dest=2)
    request = net.deliver(keep=True)
    net.deliver()
    assert net.kinds() == [ForkAccepted, ForkAccepted]
    net.deliver()  # confirms the child, which answers its parent
    net.deliver()  # the duplicate ForkAccepted is ignored
    assert net.kinds() == [ChildAccepted]
    net.deliver(keep=True)
    net.deliver()  # duplicate ChildAccepted
    net.drain()
    net.apply(2, net.rc[2].release_user(child))
    delete = net.deliver(keep=True)
    net.deliver()  # duplicate UserDelete
    assert net.rc[0].on_fork_request(2, ForkRequest(rref_id, child)) == [
        Send(2, ForkAccepted(rref_id, child))
    ]  # a late ForkRequest does not resurrect the deleted fork
    net.drain()
    net.apply(1, net.rc[1].release_user(fork))
    net.drain()
    assert net.freed == [rref_id]
    net.apply(0, net.rc[0].on_message(2, request))  # after the free: no placeholder appears
    net.apply(0, net.rc[0].on_message(2, delete))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_fork_request_before_creation_makes_placeholder() -> None:
    net = Router()
    rref_id = net.rc[1].next_rref_id()
    fork, _ = net.rc[1].new_user(rref_id, 0)
    child = net.pass_user(rref_id, fork, src=1, dest=2)
    net.deliver()  # ForkRequest overtakes the remote() request
    net.drain()
    assert net.rc[0].owner_leaks() == [rref_id]
    net.apply(2, net.rc[2].release_user(child))
    net.drain()
    assert net.freed == []  # a placeholder is never freed before its creation
    net.apply(0, net.rc[0].new_owner(rref_id, holder=1, fork_id=fork))
    net.apply(1, net.rc[1].release_user(fork))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_peer_lost_of_holder_frees() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    net.pass_user(rref_id, fork, src=1, dest=2)
    net.drain()
    net.apply(0, net.rc[0].peer_lost(1))
    assert net.freed == []
    net.apply(0, net.rc[0].peer_lost(2))
    assert net.freed == [rref_id]
    assert net.rc[0].owner_leaks() == []
    assert net.rc[0].on_fork_request(1, ForkRequest(rref_id, fork)) == []


def test_RefCounter_peer_lost_of_child_holder_releases_parent() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    net.rc[1].fork_from_user(rref_id, fork, 2)  # the pickle never reaches worker 2
    assert net.rc[1].release_user(fork) == []
    assert net.rc[1].peer_lost(2) == [Send(0, UserDelete(rref_id, fork))]
    assert net.rc[1].quiescent()
    with pytest.raises(LocalProtocolError):
        net.rc[1].fork_from_owner(rref_id, 2)


def test_RefCounter_peer_lost_of_owner_notifies_users() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    second = net.pass_user(rref_id, fork, src=1, dest=1)  # two forks of one RRef on worker 1
    other_id, other = net.remote(caller=1, owner=0)  # unconfirmed
    actions = net.rc[1].peer_lost(0)
    assert actions == [RRefLost(rref_id, 0), RRefLost(other_id, 0)]
    assert net.rc[1].user_state(second) is UserState.OWNER_LOST
    with pytest.raises(RRefOwnerLostError):
        net.rc[1].fork_from_user(rref_id, fork, 2)
    assert net.rc[1].quiescent()
    for f in (fork, second, other):
        assert net.rc[1].release_user(f) == []
    assert net.rc[1].debug_info()["user_rrefs"] == 0
    assert net.rc[1].received_user(rref_id, ForkId(2, 9), owner=0, parent=2) == [
        RRefLost(rref_id, 0)
    ]


def test_RefCounter_peer_lost_of_caller_abandons_placeholder() -> None:
    net = Router()
    rref_id = net.rc[1].next_rref_id()
    fork, _ = net.rc[1].new_user(rref_id, 0)
    child = net.pass_user(rref_id, fork, src=1, dest=2)
    net.deliver()  # placeholder on worker 0; the remote() request dies with worker 1
    actions = net.rc[0].peer_lost(1)
    assert actions == [RRefLost(rref_id, 1)]
    net.drain()
    net.apply(2, net.rc[2].peer_lost(1))
    net.apply(2, net.rc[2].release_user(child))
    net.drain()
    assert net.freed == [rref_id]
    assert net.rc[0].owner_leaks() == []
    assert net.rc[2].quiescent()


def test_RefCounter_timeout_marks_unusable_and_deletes_later() -> None:
    net = Router()
    rref_id = net.rc[1].next_rref_id()
    fork, _ = net.rc[1].new_user(rref_id, 0)
    assert net.rc[1].timeout_user(fork) == []
    assert net.rc[1].user_state(fork) is UserState.TIMED_OUT
    with pytest.raises(RRefError):
        net.rc[1].fork_from_user(rref_id, fork, 2)
    net.apply(0, net.rc[0].new_owner(rref_id, holder=1, fork_id=fork))
    net.deliver()  # the late confirmation sends the delete although the handle is held
    assert net.kinds() == [UserDelete]
    assert net.rc[1].quiescent()
    net.drain()
    assert net.freed == [rref_id]
    assert net.rc[1].release_user(fork) == []
    assert net.settled()


def test_RefCounter_forks_to_self() -> None:
    net = Router()
    rref_id = net.rc[0].next_rref_id()
    net.rc[0].new_owner(rref_id)
    own = net.rc[0].fork_from_owner(rref_id, 0)
    assert net.rc[0].received_own(rref_id, own, parent=0) == []
    assert net.rc[0].drop_local_handle(rref_id) == []  # the second handle keeps it
    user = net.rc[0].fork_from_owner(rref_id, 1)
    net.rc[1].received_user(rref_id, user, owner=0, parent=0)
    mine = net.pass_user(rref_id, user, src=1, dest=1)  # a user pickling to itself
    net.deliver()
    net.deliver()  # ForkAccepted: the ChildAccepted to itself is handled inline
    assert net.queue == []
    assert net.rc[1].debug_info()["pending_forks"] == 0
    for fork in (user, mine):
        net.apply(1, net.rc[1].release_user(fork))
    net.apply(0, net.rc[0].drop_local_handle(rref_id))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_release_all_users_settles() -> None:
    net = Router()
    refs = [net.remote(caller=1, owner=owner) for owner in (0, 2, 3)]
    net.pass_user(*refs[0], src=1, dest=2)
    net.apply(1, net.rc[1].release_all_users())
    net.apply(2, net.rc[2].release_all_users())
    assert not net.rc[1].quiescent()
    net.drain()
    assert sorted(net.freed) == sorted(rref_id for rref_id, _ in refs)
    assert net.settled()


def test_RefCounter_debug_info_counts() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    local = net.rc[1].next_rref_id()
    net.rc[1].new_owner(local)
    net.pass_user(rref_id, fork, src=1, dest=2)
    assert net.rc[1].debug_info() == {
        "owner_rrefs": 1,
        "user_rrefs": 1,
        "pending_forks": 1,
        "pending_users": 1,
        "forks_undelivered": 0,
    }
    assert net.rc[0].debug_info()["owner_rrefs"] == 1
    assert net.rc[2].debug_info()["pending_users"] == 1
    net.drain()
    assert net.rc[1].debug_info()["pending_forks"] == 0
    assert net.rc[1].debug_info()["pending_users"] == 0


def test_RefCounter_describe_names_what_is_left() -> None:
    net = Router()
    rref_id, fork = net.remote(caller=1, owner=0)
    net.pass_user(rref_id, fork, src=1, dest=2)
    owner = net.rc[0].describe()
    assert len(owner["owned"]) == 1
    assert owner["owned"][0].startswith(f"rref {rref_id.worker}:{rref_id.local_id} ")
    assert owner["users"] == []
    user = net.rc[1].describe()
    (line,) = user["users"]
    assert line.startswith(
        f"fork {fork.worker}:{fork.local_id} of {rref_id.worker}:{rref_id.local_id} owner=0 "
        "parent=None confirmed=False handle=True timed_out=False children=['"
    )
    assert len(user["pending_children"]) == 1  # the fork passed to 2, not yet confirmed
    net.drain()
    net.apply(1, net.rc[1].release_all_users())
    net.apply(2, net.rc[2].release_all_users())
    net.drain()
    assert net.rc[0].describe() == {"owned": [], "users": [], "pending_children": []}


def test_RefCounter_local_bugs_raise() -> None:
    rc = RefCounter(0)
    rref_id = rc.next_rref_id()
    with pytest.raises(LocalProtocolError):
        rc.release_user(ForkId(0, 99))
    with pytest.raises(LocalProtocolError):
        rc.new_user(rref_id, owner=0)
    with pytest.raises(LocalProtocolError):
        rc.new_owner(rref_id, holder=1)
    with pytest.raises(LocalProtocolError):
        rc.drop_local_handle(rref_id)
    rc.new_owner(rref_id)
    with pytest.raises(LocalProtocolError):
        rc.new_owner(rref_id)
    assert rc.drop_local_handle(rref_id) == [Free(rref_id)]
    with pytest.raises(LocalProtocolError):
        rc.add_local_handle(rref_id)
    theirs = RRefId(1, 1)
    fork, _ = RefCounter(2).new_user(RRefId(2, 1), 1)
    assert rc.received_user(theirs, fork, owner=1, parent=2) != []
    with pytest.raises(LocalProtocolError):
        rc.fork_from_user(theirs, ForkId(7, 7), 3)
    assert rc.release_user(fork) == []  # unconfirmed: deferred
    with pytest.raises(LocalProtocolError):
        rc.release_user(fork)
    with pytest.raises(LocalProtocolError):
        rc.peer_lost(0)


def test_RefCounter_same_fork_twice_is_peer_error() -> None:
    rc = RefCounter(0)
    rc.received_user(RRefId(1, 1), ForkId(2, 5), owner=1, parent=2)
    with pytest.raises(RemoteProtocolError):
        rc.received_user(RRefId(1, 1), ForkId(2, 5), owner=1, parent=2)


def test_RefCounter_unknown_ids_from_peers_are_ignored() -> None:
    rc = RefCounter(0)
    rref_id, fork_id = RRefId(0, 42), ForkId(3, 1)
    assert rc.on_message(1, ForkAccepted(rref_id, fork_id)) == []
    assert rc.on_message(1, ChildAccepted(rref_id, fork_id)) == []
    assert rc.on_message(1, UserDelete(rref_id, fork_id)) == []
    assert rc.on_message(1, ForkRequest(rref_id, fork_id)) == [
        Send(1, ForkAccepted(rref_id, fork_id))
    ]
    assert rc.owner_leaks() == []  # minted here and unknown: already freed


def test_RefCounter_tombstones_are_bounded() -> None:
    net = Router(tombstone_limit=1)
    rref_id, fork = net.remote(caller=1, owner=0)
    net.drain()
    children = [net.pass_user(rref_id, fork, src=1, dest=2) for _ in range(2)]
    net.drain()
    for child in children:
        net.apply(2, net.rc[2].release_user(child))
    net.drain()
    # Only the newest deleted fork is remembered: a duplicate of the older one is taken as
    # new (a documented leak), one of the newer one is rejected.
    net.rc[0].on_fork_request(2, ForkRequest(rref_id, children[1]))
    net.rc[0].on_fork_request(2, ForkRequest(rref_id, children[0]))
    net.apply(1, net.rc[1].release_user(fork))
    net.drain()
    assert net.freed == []
    net.apply(0, net.rc[0].on_user_delete(2, UserDelete(rref_id, children[0])))
    assert net.freed == [rref_id]


def test_RefCounter_messages_are_frozen() -> None:
    message = ForkRequest(RRefId(0, 1), ForkId(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.fork_id = ForkId(1, 3)  # type: ignore[misc]
    assert not hasattr(message, "__dict__")
    assert message == ForkRequest(RRefId(0, 1), ForkId(1, 2))


def test_RefCounter_late_fork_request_after_failure_free_leaves_no_entry() -> None:
    net = Router()
    rref_id, root = net.remote(caller=1, owner=0)
    net.drain()
    fork_p = net.pass_user(rref_id, root, src=1, dest=2)
    net.drain()
    net.apply(1, net.rc[1].release_user(root))
    net.drain()
    child = net.rc[2].fork_from_user(rref_id, fork_p, 3)
    net.apply(3, net.rc[3].received_user(rref_id, child, owner=0, parent=2))
    net.apply(0, net.rc[0].peer_lost(2))  # the parent dies before its child registers
    assert net.freed == [rref_id]
    net.deliver()  # the child's ForkRequest names a value freed already
    assert net.rc[0].owner_leaks() == []  # remembered as freed: no placeholder
    net.apply(3, net.rc[3].peer_lost(2))
    net.drain()
    net.apply(3, net.rc[3].release_user(child))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled(2)


# -- frames lost with their connection (ForkQuery / ForkUnknown) --------------------------


def test_RefCounter_owner_fork_lost_with_its_frame_is_undone_after_a_query() -> None:
    net = Router()
    rref_id = net.rc[0].next_rref_id()
    net.rc[0].new_owner(rref_id)
    fork = net.rc[0].fork_from_owner(rref_id, 1)  # its frame dies with the connection
    assert net.rc[0].drop_local_handle(rref_id) == []  # the lost fork keeps the value
    net.apply(0, [Send(1, ForkQuery(rref_id, fork))])
    net.deliver()
    assert net.queue == [(1, 0, ForkUnknown(rref_id, fork))]
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()
    net.apply(1, [Send(0, ForkUnknown(rref_id, fork))])  # a resent duplicate: nothing
    net.drain()
    assert net.freed == [rref_id]


def test_RefCounter_query_about_a_fork_that_arrived_is_answered_by_silence() -> None:
    net = Router()
    rref_id = net.rc[0].next_rref_id()
    net.rc[0].new_owner(rref_id)
    fork = net.rc[0].fork_from_owner(rref_id, 1)
    net.rc[1].received_user(rref_id, fork, owner=0, parent=0)  # it did arrive
    net.apply(1, net.rc[1].release_user(fork))  # and is gone already
    net.apply(0, [Send(1, ForkQuery(rref_id, fork))])
    net.drain()
    assert net.undone == []
    assert net.freed == []  # the owner still holds its own handle
    net.apply(0, net.rc[0].drop_local_handle(rref_id))
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_pending_child_lost_with_its_frame_lets_the_parent_go() -> None:
    net = Router()
    rref_id, fork_a = net.remote(caller=1, owner=0)
    net.drain()
    child = net.rc[1].fork_from_user(rref_id, fork_a, 2)  # lost on the way to 2
    net.apply(1, net.rc[1].release_user(fork_a))
    assert net.queue == []  # the pending child holds the parent's delete back
    net.apply(1, [Send(2, ForkQuery(rref_id, child))])
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()


def test_RefCounter_remote_lost_with_its_frame_ends_unusable_and_settled() -> None:
    net = Router()
    rref_id = net.rc[1].next_rref_id()
    fork, _ = net.rc[1].new_user(rref_id, 0)  # the remote() request never reaches 0
    child = net.rc[1].fork_from_user(rref_id, fork, 2)  # but a fork of it reaches 2
    net.apply(2, net.rc[2].received_user(rref_id, child, owner=0, parent=1))
    net.deliver()  # 2's ForkRequest: the owner makes a placeholder for the remote()
    assert net.rc[0].owner_leaks() == [rref_id]
    net.apply(1, [Send(0, ForkQuery(rref_id, fork))])
    net.drain()
    assert net.undone == [(1, RemoteUndelivered(rref_id, fork, 0))]
    assert net.rc[1].debug_info()["forks_undelivered"] == 1
    assert net.rc[1].user_state(fork) is UserState.OWNER_LOST
    assert (0, RRefLost(rref_id, 1)) in net.lost  # the placeholder gives up waiting
    net.apply(1, net.rc[1].release_user(fork))
    net.apply(2, net.rc[2].release_user(child))
    net.drain()
    assert net.freed == [rref_id]
    assert net.settled()
