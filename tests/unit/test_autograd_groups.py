"""Keeping process groups out of DDP's teardown (``asyncrpc.autograd.groups``): a group is
kept while torch has it, let go at the second look that finds torch has let go of it, and
one sweeper at a time is asked for."""

from __future__ import annotations

import threading

from asyncrpc.autograd.groups import GroupKeeper


class _Torch:
    """Which fake groups torch has registered."""

    def __init__(self) -> None:
        self.groups: list[object] = []

    def registered(self, group: object) -> bool:
        return any(group is held for held in self.groups)


def test_GroupKeeper_keeps_a_group_while_torch_has_it() -> None:
    torch = _Torch()
    group = object()
    torch.groups.append(group)
    keeper = GroupKeeper(torch.registered)
    keeper.keep(group)
    keeper.keep(group)  # every pass keeps it again: still one
    for _ in range(3):
        assert keeper.sweep() == ([], True)
    assert keeper.held == 1


def test_GroupKeeper_lets_go_at_the_second_look_after_torch_let_go() -> None:
    torch = _Torch()
    group = object()
    torch.groups.append(group)
    keeper = GroupKeeper(torch.registered)
    keeper.keep(group)
    torch.groups.clear()  # destroy_process_group; the program may still drop its DDP
    assert keeper.sweep() == ([], True)
    let_go, again = keeper.sweep()
    assert let_go == [group]
    assert again is False
    assert keeper.held == 1  # until its teardown is over: the caller says so
    keeper.dropped(1)
    assert keeper.held == 0


def test_GroupKeeper_settle_waits_for_groups_torch_let_go_of() -> None:
    # What the exit hook waits for: a group torch let go of, held or tearing down, keeps
    # the process from ending (a daemon thread cut off in gloo's teardown aborts it).
    torch = _Torch()
    group, kept_by_torch = object(), object()
    torch.groups.append(kept_by_torch)
    keeper = GroupKeeper(torch.registered)
    keeper.keep(group)
    keeper.keep(kept_by_torch)
    assert keeper.settle(0.05) is False  # torch no longer has ``group``: still held here
    keeper.sweep()
    assert keeper.sweep()[0] == [group]
    assert keeper.settle(0.05) is False  # let go, its teardown not over yet
    threading.Timer(0.1, keeper.dropped, args=(1,)).start()
    assert keeper.settle(5.0) is True  # the one torch still has does not count
    assert keeper.held == 1


def test_GroupKeeper_group_back_in_torch_starts_its_wait_again() -> None:
    torch = _Torch()
    group = object()
    torch.groups.append(group)
    keeper = GroupKeeper(torch.registered)
    keeper.keep(group)
    torch.groups.clear()
    assert keeper.sweep() == ([], True)
    torch.groups.append(group)
    assert keeper.sweep() == ([], True)
    torch.groups.clear()
    assert keeper.sweep() == ([], True)  # a first look again, not a second
    assert keeper.sweep()[0] == [group]


def test_GroupKeeper_asks_for_one_sweeper_until_it_stops() -> None:
    torch = _Torch()
    first, second = object(), object()
    torch.groups.append(first)
    keeper = GroupKeeper(torch.registered)
    assert keeper.keep(first) is True  # start one
    assert keeper.keep(second) is False  # one runs already
    assert keeper.sweep() == ([], True)  # second: seen gone once
    assert keeper.sweep() == ([second], True)  # first is still torch's
    torch.groups.clear()
    assert keeper.sweep() == ([], True)
    assert keeper.sweep() == ([first], False)  # nothing left: the sweeper stops
    assert keeper.keep(first) is True  # and the next group kept starts a new one
