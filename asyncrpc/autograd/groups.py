"""Keeping torch's default process group out of DDP's teardown (layer L3).

A backward pass that may feed DDP's reducer runs on torch's engine (``graph.py``). The
reducer holds its process group from C++. A program that destroys the group
(``destroy_process_group``) and then drops its DDP module makes the reducer drop the
group's last reference on the program's thread with the GIL held, and tearing down a gloo
group joins the gloo threads there. A gloo thread that is finishing a collective on a
tensor made in Python (DDP's ``join()`` makes such tensors, and drops their work handles)
needs the GIL to let go of that tensor: the two threads then wait for each other for good.
torch's own RPC hangs the same way; the window is small, and wider on a loaded machine.

The group's Python object does release the GIL before tearing the group down. So the
default group is kept here from the first pass on torch's engine, and let go on a thread
of this module's once torch no longer has it as its default group and the program has had
at least ``SWEEP_S`` seconds to drop its DDP modules: the last reference is then this
one, and the gloo threads finish their work while the group waits for them.

State is process-wide, like torch's process groups and its distributed engine.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["SWEEP_S", "GroupKeeper", "keep_default_group", "kept_groups"]

# Seconds between two looks at the kept groups. A group torch has destroyed is let go at
# the second look that finds it so: 0.5 to 1 s after ``destroy_process_group``. A DDP
# module dropped within that time never tears its group down; meanwhile the group keeps
# its store, so a new group rendezvousing on the same TCP port would find it taken.
SWEEP_S = 0.5


class GroupKeeper:
    """The process groups kept alive, and which of them to let go (``sweep``)."""

    def __init__(self, registered: Callable[[Any], bool]) -> None:
        self._registered = registered  # whether torch still has this group
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._held: list[Any] = []
        self._seen_gone: set[int] = set()  # ids of held groups torch no longer had
        self._sweeping = False
        self._dropping = 0  # groups let go whose teardown has not finished yet

    def keep(self, group: Any) -> bool:
        """Hold ``group`` (again: a no-op); True when nobody sweeps yet, and the caller
        must start the sweeps (``sweep`` until it says to stop)."""
        with self._lock:
            if not any(held is group for held in self._held):
                self._held.append(group)
            if self._sweeping:
                return False
            self._sweeping = True
            return True

    def sweep(self) -> tuple[list[Any], bool]:
        """One look: the groups to let go (torch had let go of them at the previous look
        too), and whether to look again (something is still held)."""
        let_go: list[Any] = []
        with self._lock:
            for group in list(self._held):
                if self._registered(group):
                    self._seen_gone.discard(id(group))
                elif id(group) in self._seen_gone:
                    self._seen_gone.discard(id(group))
                    self._held.remove(group)
                    let_go.append(group)
                    self._dropping += 1
                else:
                    self._seen_gone.add(id(group))
            self._sweeping = bool(self._held)
            return let_go, self._sweeping

    def dropped(self, count: int) -> None:
        """The teardown of ``count`` groups ``sweep`` let go of has finished."""
        with self._changed:
            self._dropping -= count
            self._changed.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no group torch has let go of is held
        or tearing down; whether that came."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._dropping or any(not self._registered(g) for g in self._held):
                left = deadline - time.monotonic()  # bounded by the deadline
                if left <= 0:
                    return False
                self._changed.wait(min(left, SWEEP_S))
            return True

    @property
    def held(self) -> int:
        """How many groups are kept now, those still tearing down included."""
        with self._lock:
            return len(self._held) + self._dropping


def _is_default_group(group: Any) -> bool:
    return dist.is_initialized() and dist.group.WORLD is group


_keeper = GroupKeeper(_is_default_group)


def keep_default_group() -> None:
    """Keep torch's default process group, if there is one, until torch lets go of it
    (called before each pass on torch's engine: microseconds)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    if group is not None and _keeper.keep(group):
        threading.Thread(
            target=_sweep_while_held, args=(_keeper,), daemon=True,
            name="asyncrpc-group-keeper",
        ).start()  # fmt: skip


def kept_groups() -> int:
    """How many process groups are kept now (for tests and debugging)."""
    return _keeper.held


def _sweep_while_held(keeper: GroupKeeper) -> None:
    going = True
    # Ends at the first look that finds nothing held; a group torch keeps for the
    # process's life is looked at every SWEEP_S seconds as long (microseconds each).
    while going:
        time.sleep(SWEEP_S)
        let_go, going = keeper.sweep()
        # The last references go here: each group's teardown releases the GIL and waits
        # for its gloo threads, on this thread rather than the program's.
        count = len(let_go)
        let_go.clear()
        if count:
            keeper.dropped(count)


# A process that ends while this module's thread tears a group down (a daemon thread, cut
# off at exit in the middle of gloo's teardown) aborts: "terminate called without an active
# exception". So does one that ends with a group torch let go of still held here, torn
# down during finalization. At exit the sweeps are given time to finish that work.
_EXIT_WAIT_S = 5.0


def _settle_at_exit() -> None:
    _keeper.settle(_EXIT_WAIT_S)


atexit.register(_settle_at_exit)
