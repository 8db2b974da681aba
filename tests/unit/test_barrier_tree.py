"""The tree a shutdown barrier's news travels down (``group/tree.py``, no I/O)."""

from __future__ import annotations

import pytest

from asyncrpc.runtime.group.tree import FANOUT, children, neighbours, recipients


def _reached(root: int, size: int, dead: set[int]) -> list[int]:
    """Every rank told, starting from ``root``, each telling its recipients once."""
    told, pending = [root], [root]
    while pending:
        rank = pending.pop()
        for child in recipients(rank, root, size, dead):
            told.append(child)
            pending.append(child)
    return told


@pytest.mark.parametrize("size", [1, 2, 3, 7, 62, 1000])
@pytest.mark.parametrize("root_at", [0, 0.5, 1])
def test_tree_reaches_every_rank_exactly_once(size: int, root_at: float) -> None:
    root = min(int(size * root_at), size - 1)
    told = _reached(root, size, set())
    assert sorted(told) == list(range(size))


def test_tree_is_shallow_and_each_rank_sends_at_most_fanout_frames() -> None:
    size, root = 1000, 417
    depth = {root: 0}
    for rank in sorted(range(size), key=lambda r: (r - root) % size):
        kids = children(rank, root, size)
        assert len(kids) <= FANOUT
        for kid in kids:
            depth[kid] = depth[rank] + 1
    assert max(depth.values()) == 9  # log2(1000) rounded down: ten levels


def test_tree_skips_a_dead_child_and_tells_its_children() -> None:
    size, root = 20, 3
    assert children(3, root, size) == [4, 5]
    assert children(4, root, size) == [6, 7]
    assert recipients(3, root, size, {4}) == [5, 6, 7]
    # Dead ranks anywhere: everyone alive is still told once, the dead never.
    dead = {4, 6, 11, 2}
    told = _reached(root, size, dead)
    assert sorted(told) == sorted(set(range(size)) - dead)


def test_tree_rejects_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        children(5, 0, 5)
    with pytest.raises(ValueError, match="-1"):
        recipients(0, -1, 5, set())


def test_tree_neighbours_are_the_parent_and_the_children() -> None:
    size, root = 1000, 0
    assert neighbours(0, root, size) == [1, 2]
    assert neighbours(5, root, size) == [2, 11, 12]
    assert neighbours(999, root, size) == [499]
    # Every rank is its parent's child, and the root of another tree has no parent.
    for rank in range(1, size):
        assert rank in children(neighbours(rank, root, size)[0], root, size)
    assert neighbours(7, 7, 10) == [8, 9]
