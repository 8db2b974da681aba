"""Who tells whom that a shutdown barrier is open: a tree of workers (layer L2.3, no I/O).

The worker whose arrival completes a barrier is the root; rank r sits at position
(r - root) mod N of a binary tree laid over the ranks, and tells its two children. The
news reaches every worker in about log2(N) hops, each worker sending two frames, so a
barrier costs the store no request per waiter. A child known dead is skipped: its own
children are told instead, so one dead worker does not cut off its subtree.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["FANOUT", "children", "neighbours", "recipients"]

# Two children per worker: depth 10 at 1,000 workers, two frames out per worker. More
# children make the tree shallower but the sender's share of the frames larger.
FANOUT = 2


def children(rank: int, root: int, size: int) -> list[int]:
    """The ranks ``rank`` tells, in the tree of ``size`` workers rooted at ``root``.

    Raises:
        ValueError: a rank outside ``[0, size)``.
    """
    if not 0 <= rank < size or not 0 <= root < size:
        raise ValueError(f"ranks {rank} and {root} must be in [0, {size})")
    position = (rank - root) % size
    first = position * FANOUT + 1
    return [(root + p) % size for p in range(first, min(first + FANOUT, size))]


def recipients(rank: int, root: int, size: int, dead: Collection[int]) -> list[int]:
    """The live ranks ``rank`` tells: its children, with each dead child replaced by the
    dead child's own recipients (a dead subtree root does not cut the news off).

    Raises:
        ValueError: a rank outside ``[0, size)``.
    """
    told: list[int] = []
    pending = children(rank, root, size)
    while pending:  # bounded: each rank is visited once, as the tree has no cycle
        child = pending.pop(0)
        if child in dead:
            pending.extend(children(child, root, size))
        else:
            told.append(child)
    return told


def neighbours(rank: int, root: int, size: int) -> list[int]:
    """The ranks ``rank`` hears from or tells in the tree rooted at ``root`` when nobody
    died: its parent (none for the root), then its children.

    Raises:
        ValueError: a rank outside ``[0, size)``.
    """
    kids = children(rank, root, size)
    position = (rank - root) % size
    if position == 0:
        return kids
    return [(root + (position - 1) // FANOUT) % size, *kids]
