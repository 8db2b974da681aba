"""Model-based tests of asyncrpc.protocol.refcount: random workloads over a network that reorders.

Every refcount message, pickled RRef and remote() request waits in flight until a rule
delivers it; rules may take ANY element in flight (not only the oldest of its connection),
deliver a copy of a refcount message in flight, or replay any message delivered before.
Real connections are FIFO and never duplicate, so this is stricter than production; the
state machine stays safe and leak-free anyway, so no ordering restriction is needed.
Pickled RRefs and remote() requests are never duplicated: they are payloads of user RPCs,
which run user code, and a duplicated one would be a second unpickling of one fork.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asyncrpc.errors import LocalProtocolError
from asyncrpc.protocol.refcount import RefCounter, UserState
from asyncrpc.protocol.refmessages import (
    Action,
    ForkId,
    ForkQuery,
    Free,
    Message,
    RemoteUndelivered,
    RRefId,
    RRefLost,
    Send,
    UserDelete,
)

N = 4
SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)
USABLE = (UserState.UNCONFIRMED, UserState.CONFIRMED)

workers = st.integers(0, N - 1)
picks = st.integers(0, 1 << 16)  # an index modulo the list's length: shrinks to the oldest


@dataclass
class Handle:
    """A Python RRef object on ``worker``: a user fork, or an owner handle (fork_id None)."""

    worker: int
    rref_id: RRefId
    fork_id: ForkId | None
    owner: int
    root: bool = False  # the fork of the worker's own remote() call


@dataclass(frozen=True)
class Pickled:
    """An RRef pickled into an RPC from ``src`` to ``dst``, in flight."""

    src: int
    dst: int
    rref_id: RRefId
    fork_id: ForkId
    owner: int


@dataclass(frozen=True)
class Creation:
    """A remote() request from ``src`` to its owner ``dst``, in flight."""

    src: int
    dst: int
    rref_id: RRefId
    fork_id: ForkId


class RefcountMachine(RuleBasedStateMachine):
    """N workers; invariant: no value is freed while anything still references it."""

    def __init__(self) -> None:
        super().__init__()
        self.rc = [RefCounter(rank) for rank in range(N)]
        self.messages: list[tuple[int, int, Message]] = []
        self.history: list[tuple[int, int, Message]] = []  # every message delivered
        self.pickled: list[Pickled] = []
        self.creations: list[Creation] = []
        self.handles: list[Handle] = []
        # user fork -> (holder, RRef), until its UserDelete is sent
        self.forks: dict[ForkId, tuple[int, RRefId]] = {}
        self.rrefs: set[RRefId] = set()
        self.freed: set[RRefId] = set()
        self.dead: set[int] = set()
        self.tainted: set[RRefId] = set()  # touched by a dead worker: safety not promised
        self.zombies: list[Handle] = []  # unusable handles kept to the very end
        self.never_made: set[RRefId] = set()  # remote() requests lost with a connection

    # -- the network -----------------------------------------------------------------------

    def can_call(self, src: int, dest: int) -> bool:
        return dest not in self.dead

    def send(self, src: int, dest: int, message: Message) -> None:
        self.messages.append((src, dest, message))

    def apply(self, src: int, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(dest, message):
                    if isinstance(message, UserDelete):
                        assert message.fork_id in self.forks, "UserDelete sent twice"
                        del self.forks[message.fork_id]
                    self.send(src, dest, message)
                case Free(rref_id):
                    assert rref_id not in self.freed, "freed twice"
                    self.freed.add(rref_id)
                case RRefLost(rref_id):
                    assert rref_id in self.tainted, "RRefLost without a lost worker"
                case RemoteUndelivered(rref_id, fork_id):
                    assert rref_id in self.never_made, "remote() undone but it was delivered"
                    del self.forks[fork_id]  # unusable: it will send no UserDelete

    def usable(self, handle: Handle) -> bool:
        if handle.fork_id is None:
            return True
        return self.rc[handle.worker].user_state(handle.fork_id) in USABLE

    def release(self, handle: Handle) -> None:
        rc = self.rc[handle.worker]
        if handle.fork_id is None:
            self.apply(handle.worker, rc.drop_local_handle(handle.rref_id))
        else:
            self.apply(handle.worker, rc.release_user(handle.fork_id))

    def do_create(self, pick: int) -> None:
        c = self.creations.pop(pick % len(self.creations))
        self.apply(c.dst, self.rc[c.dst].new_owner(c.rref_id, holder=c.src, fork_id=c.fork_id))

    def do_unpickle(self, pick: int) -> None:
        p = self.pickled.pop(pick % len(self.pickled))
        rc = self.rc[p.dst]
        if p.dst == p.owner:
            actions = rc.received_own(p.rref_id, p.fork_id, parent=p.src)
            if not any(isinstance(a, RRefLost) for a in actions):
                self.handles.append(Handle(p.dst, p.rref_id, None, p.owner))
        else:
            self.forks[p.fork_id] = (p.dst, p.rref_id)
            actions = rc.received_user(p.rref_id, p.fork_id, p.owner, parent=p.src)
            self.handles.append(Handle(p.dst, p.rref_id, p.fork_id, p.owner))
        self.apply(p.dst, actions)

    def connected(self, src: int, dst: int) -> bool:
        return True

    def do_deliver(self, pick: int) -> None:
        src, dst, message = self.messages.pop(pick % len(self.messages))
        self.history.append((src, dst, message))
        self.apply(dst, self.rc[dst].on_message(src, message))

    # -- rules -----------------------------------------------------------------------------

    @rule(caller=workers, hop=st.integers(1, N - 1))
    def remote(self, caller: int, hop: int) -> None:
        owner = (caller + hop) % N
        if caller in self.dead or not self.can_call(caller, owner):
            return
        rref_id = self.rc[caller].next_rref_id()
        fork_id, actions = self.rc[caller].new_user(rref_id, owner)
        self.apply(caller, actions)
        self.rrefs.add(rref_id)
        self.forks[fork_id] = (caller, rref_id)
        self.handles.append(Handle(caller, rref_id, fork_id, owner, root=True))
        if owner in self.dead:
            self.tainted.add(rref_id)
        else:
            self.creations.append(Creation(caller, owner, rref_id, fork_id))

    @rule(worker=workers)
    def local_rref(self, worker: int) -> None:
        if worker in self.dead:
            return
        rref_id = self.rc[worker].next_rref_id()
        self.apply(worker, self.rc[worker].new_owner(rref_id))
        self.rrefs.add(rref_id)
        self.handles.append(Handle(worker, rref_id, None, worker))

    @precondition(lambda self: self.handles)
    @rule(pick=picks, dest=workers)
    def pickle(self, pick: int, dest: int) -> None:
        handle = self.handles[pick % len(self.handles)]
        rc = self.rc[handle.worker]
        if not self.can_call(handle.worker, dest):
            return
        if handle.fork_id is None:
            fork_id = rc.fork_from_owner(handle.rref_id, dest)
        elif rc.user_state(handle.fork_id) in USABLE:
            fork_id = rc.fork_from_user(handle.rref_id, handle.fork_id, dest)
        else:
            return
        if dest in self.dead:
            self.tainted.add(handle.rref_id)
        else:
            self.pickled.append(Pickled(handle.worker, dest, handle.rref_id, fork_id, handle.owner))

    @precondition(lambda self: self.pickled)
    @rule(pick=picks)
    def unpickle(self, pick: int) -> None:
        self.do_unpickle(pick)

    @precondition(lambda self: self.creations)
    @rule(pick=picks)
    def create(self, pick: int) -> None:
        self.do_create(pick)

    @precondition(lambda self: self.messages)
    @rule(pick=picks)
    def deliver(self, pick: int) -> None:
        self.do_deliver(pick)

    @precondition(lambda self: self.messages)
    @rule(pick=picks)
    def duplicate(self, pick: int) -> None:
        src, dst, message = self.messages[pick % len(self.messages)]
        self.history.append((src, dst, message))
        self.apply(dst, self.rc[dst].on_message(src, message))

    @precondition(lambda self: self.history)
    @rule(pick=picks)
    def replay(self, pick: int) -> None:
        """A duplicate of a message delivered long ago arrives now."""
        src, dst, message = self.history[pick % len(self.history)]
        if self.connected(src, dst):
            self.apply(dst, self.rc[dst].on_message(src, message))

    @precondition(lambda self: self.handles)
    @rule(pick=picks)
    def drop(self, pick: int) -> None:
        self.release(self.handles.pop(pick % len(self.handles)))

    @precondition(lambda self: self.handles)
    @rule(pick=picks)
    def time_out(self, pick: int) -> None:
        handle = self.handles[pick % len(self.handles)]
        if handle.root and handle.fork_id is not None:
            rc = self.rc[handle.worker]
            if rc.user_state(handle.fork_id) is UserState.UNCONFIRMED:
                self.apply(handle.worker, rc.timeout_user(handle.fork_id))

    @rule()
    def delay(self) -> None:
        pass

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def never_freed_while_referenced(self) -> None:
        # Timed-out and owner-lost handles are unusable: they reference nothing any more.
        referenced = {h.rref_id for h in self.handles if self.usable(h)}
        referenced.update(p.rref_id for p in self.pickled)
        referenced.update(r for _, r in self.forks.values())
        assert not referenced & (self.freed - self.tainted)

    def drain(self) -> None:
        """Deliver everything in flight, refcount messages first (they overtake the rest)."""
        while self.messages or self.pickled or self.creations:
            if self.messages:
                self.do_deliver(0)
            elif self.pickled:
                self.do_unpickle(0)
            else:
                self.do_create(0)
            self.never_freed_while_referenced()

    def settle(self) -> None:
        """Deliver everything, then drop the usable handles oldest first (parents before
        children: the order that exposes a premature free), delivering after each drop."""
        self.drain()
        self.zombies = [h for h in self.handles if not self.usable(h)]
        self.handles = [h for h in self.handles if self.usable(h)]
        while self.handles:
            self.release(self.handles.pop(0))
            self.drain()

    def check_settled(self) -> None:
        for rank, rc in enumerate(self.rc):
            if rank not in self.dead:
                assert rc.quiescent(), (rank, rc.debug_info())
                assert rc.owner_leaks() == [], (rank, rc.owner_leaks())

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a step failed already: keep its error
        self.settle()
        # Timed-out and owner-lost handles are still held: the protocol must be done anyway.
        self.check_settled()
        # Late duplicates of every message ever delivered change nothing.
        for src, dst, message in self.history:
            if self.connected(src, dst):
                self.apply(dst, self.rc[dst].on_message(src, message))
        self.drain()
        self.check_settled()
        for handle in self.zombies:
            self.release(handle)
            assert handle.fork_id is not None
            with pytest.raises(LocalProtocolError):
                self.rc[handle.worker].user_state(handle.fork_id)
        if not self.dead:
            # A remote() lost with its connection makes no value (freed only if a placeholder
            # was made for it).
            assert self.freed - self.never_made == self.rrefs - self.never_made
            assert self.forks == {}


class FailureMachine(RefcountMachine):
    """Also kills one worker; survivors learn it one at a time, as connections break.

    Until a survivor calls peer_lost, what the dead worker sent it may still arrive and it may
    still send to the dead worker (lost in transit). RRefs the dead worker touched are
    "tainted": a survivor's fork whose ancestor died may lose its value (as in torch), so the
    safety invariant covers only untainted RRefs; liveness is checked for all.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unaware: set[int] = set()

    def can_call(self, src: int, dest: int) -> bool:
        return dest not in self.dead or src in self.unaware

    def send(self, src: int, dest: int, message: Message) -> None:
        if dest in self.dead:
            self.tainted.add(message.rref_id)
        else:
            super().send(src, dest, message)

    def touches(self, worker: int) -> set[RRefId]:
        touched = {h.rref_id for h in self.handles if worker in (h.worker, h.owner)}
        touched.update(p.rref_id for p in self.pickled if worker in (p.src, p.dst, p.owner))
        touched.update(c.rref_id for c in self.creations if worker in (c.src, c.dst))
        touched.update(m.rref_id for s, d, m in self.messages if worker in (s, d))
        touched.update(r for r in self.rrefs if r.worker == worker)
        return touched

    @precondition(lambda self: not self.dead)
    @rule(worker=workers)
    def kill(self, worker: int) -> None:
        self.tainted |= self.touches(worker)
        self.dead.add(worker)
        self.unaware = set(range(N)) - self.dead
        self.handles = [h for h in self.handles if h.worker != worker]
        self.pickled = [p for p in self.pickled if p.dst != worker]
        self.creations = [c for c in self.creations if c.dst != worker]
        self.messages = [m for m in self.messages if m[1] != worker]
        self.forks = {f: hr for f, hr in self.forks.items() if hr[0] != worker}

    @precondition(lambda self: self.unaware)
    @rule(pick=picks)
    def notice(self, pick: int) -> None:
        survivor = sorted(self.unaware)[pick % len(self.unaware)]
        self.notice_by(survivor)

    def notice_by(self, survivor: int) -> None:
        (dead,) = self.dead
        self.unaware.discard(survivor)
        # The connection is closed: nothing more from the dead worker reaches the survivor.
        self.pickled = [p for p in self.pickled if (p.src, p.dst) != (dead, survivor)]
        self.creations = [c for c in self.creations if (c.src, c.dst) != (dead, survivor)]
        self.messages = [m for m in self.messages if (m[0], m[1]) != (dead, survivor)]
        self.apply(survivor, self.rc[survivor].peer_lost(dead))

    def connected(self, src: int, dst: int) -> bool:
        return src not in self.dead and dst not in self.dead

    def settle(self) -> None:
        for survivor in sorted(self.unaware):
            self.notice_by(survivor)
        super().settle()


class ReconnectMachine(RefcountMachine):
    """Also drops connections between live workers: the refcount messages in flight
    between the two are lost, and each side sends its unacknowledged ones again on the
    next connection (what ``asyncrpc/protocol/reflog.py`` does). An acknowledgement (a Pong)
    trims a log's prefix that has been delivered.

    Pickled RRefs and remote() requests in flight between the two are lost too (their
    calls fail); their senders ask about them with ForkQuery, and also about some that did
    arrive (a frame not yet acknowledged is in doubt either way).
    """

    def __init__(self) -> None:
        super().__init__()
        self.unacked: dict[tuple[int, int], list[Message]] = {}
        self.drops = 0
        self.arrived: dict[tuple[int, int], list[tuple[RRefId, ForkId]]] = {}

    def do_unpickle(self, pick: int) -> None:
        p = self.pickled[pick % len(self.pickled)]
        self.arrived.setdefault((p.src, p.dst), []).append((p.rref_id, p.fork_id))
        super().do_unpickle(pick)

    def do_create(self, pick: int) -> None:
        c = self.creations[pick % len(self.creations)]
        self.arrived.setdefault((c.src, c.dst), []).append((c.rref_id, c.fork_id))
        super().do_create(pick)

    def send(self, src: int, dest: int, message: Message) -> None:
        super().send(src, dest, message)
        self.unacked.setdefault((src, dest), []).append(message)

    @precondition(lambda self: any(self.unacked.values()))
    @rule(pick=picks)
    def acknowledge(self, pick: int) -> None:
        links = sorted(link for link, log in self.unacked.items() if log)
        link = links[pick % len(links)]
        in_flight = [m for s, d, m in self.messages if (s, d) == link]
        log = self.unacked[link]
        while log and not any(m is log[0] for m in in_flight):  # bounded by the log
            log.pop(0)

    @rule(a=workers, b=workers)
    def drop_connection(self, a: int, b: int) -> None:
        if a == b:
            return
        self.drops += 1
        self.messages = [(s, d, m) for s, d, m in self.messages if {s, d} != {a, b}]
        for link in ((a, b), (b, a)):
            for message in self.unacked.get(link, []):  # resent on the new connection
                RefcountMachine.send(self, link[0], link[1], message)
        lost = [p for p in self.pickled if {p.src, p.dst} == {a, b}]
        created = [c for c in self.creations if {c.src, c.dst} == {a, b}]
        self.pickled = [p for p in self.pickled if {p.src, p.dst} != {a, b}]
        self.creations = [c for c in self.creations if {c.src, c.dst} != {a, b}]
        for p in lost:
            self.send(p.src, p.dst, ForkQuery(p.rref_id, p.fork_id))
        for c in created:
            self.never_made.add(c.rref_id)
            self.tainted.add(c.rref_id)  # its value never exists: nothing to keep safe
            self.send(c.src, c.dst, ForkQuery(c.rref_id, c.fork_id))
        for link in ((a, b), (b, a)):  # in doubt, but they did arrive: the answer is no news
            for rref_id, fork_id in self.arrived.pop(link, [])[-3:]:
                self.send(link[0], link[1], ForkQuery(rref_id, fork_id))


def test_RefCounter_survives_dropped_connections_with_resent_logs() -> None:
    run_state_machine_as_test(ReconnectMachine, settings=SETTINGS)


def test_RefCounter_leaks_when_dropped_messages_are_not_resent() -> None:
    """The test above can fail: without the resent log, a drop loses a message for good."""
    rc = [RefCounter(rank) for rank in range(2)]
    rref_id = rc[0].next_rref_id()
    fork_id, _ = rc[0].new_user(rref_id, 1)
    created = rc[1].new_owner(rref_id, holder=0, fork_id=fork_id)  # Send(0, ForkAccepted)
    assert [type(a) for a in created] == [Send]
    # The ForkAccepted is dropped with the connection and never resent: the user cannot
    # release its fork, and the owner keeps the value for good.
    assert rc[0].release_user(fork_id) == []
    assert rc[1].owner_leaks() == [rref_id]
    assert not rc[0].quiescent()
    # Resent on the next connection: both settle.
    (send,) = created
    assert isinstance(send, Send)
    released = rc[0].on_message(1, send.message)  # the deferred UserDelete goes now
    for action in released:
        if isinstance(action, Send):
            rc[1].on_message(0, action.message)
    assert rc[1].owner_leaks() == []
    assert rc[0].quiescent()


def test_RefCounter_safe_and_leak_free_under_reordering_and_duplicates() -> None:
    run_state_machine_as_test(RefcountMachine, settings=SETTINGS)


def test_RefCounter_survivors_settle_after_a_worker_dies() -> None:
    run_state_machine_as_test(FailureMachine, settings=SETTINGS)
