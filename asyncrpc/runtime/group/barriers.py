"""Store barriers, and the store requests of a graceful shutdown (layer L2.3).

A barrier's arrivals are bits of one counter per 62 ranks: an arrival is one ``add``. The
arrival that fills a block adds one to a counter of full blocks, and the one that fills
the last block knows it completed the barrier: it sets the barrier's "open" key and (in
``shutdown.py``) tells the others down a tree of peer connections. A waiter checks the
one "open" key only as a fallback (a lost message). A dead rank is counted once, by the
first survivor to set its bit. Who is missing is the clear bits, read in two requests.
(A start-up gate is a store ``wait``: ``wait_for``.)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TypeVar

from asyncrpc.errors import ShutdownError
from asyncrpc.runtime.group.quiet import QuietStore
from asyncrpc.runtime.group.stores import first_line

__all__ = ["StoreBarriers", "timed_out"]

_PREFIX = "asyncrpc/"
_T = TypeVar("_T")
# Barrier polls back off from this to _POLL_S: a healthy group's barriers take
# milliseconds, a worker serving its peers from inside shutdown() polls 4 times a second.
_FIRST_POLL_S = 0.005
_POLL_S = 0.25
_LOST_LIST = _PREFIX + "lost_list"
# Ranks per barrier counter: their bits fit a signed 64-bit value (torch's ``add``).
_BLOCK = 62
# The count of a barrier's full blocks is in the low 32 bits of its counter; counting a
# dead rank adds _DEAD_FLAG (the high bits say some rank died).
_COUNT_MASK = (1 << 32) - 1
_DEAD_FLAG = 1 << 32


def timed_out(exc: BaseException) -> bool:
    """Whether a store's ``wait`` failed for its timeout (the store still answers), not
    because the store is gone (torch raises both as RuntimeError subclasses)."""
    if type(exc).__name__ == "DistNetworkError":
        return False
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


def _poll_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Ask ``condition`` (a store request) until it holds or ``seconds`` pass, pausing
    5 ms at first, doubling up to 250 ms; whether it held (asked once more after the
    last pause)."""
    deadline = time.monotonic() + seconds
    delay = _FIRST_POLL_S
    while not condition():  # bounded by the deadline
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, _POLL_S)
    return True


class StoreBarriers:
    """The barrier keys of a group's store (a base of ``StoreGroup``)."""

    rank: int
    world_size: int | None
    host_name: str | None

    def __init__(self, store: QuietStore) -> None:
        self.store = store
        # The barriers this worker's own arrival or count completed (it tells the others),
        # each with whether some rank was counted dead there.
        self.opened_here: dict[str, bool] = {}

    # -- waiting ---------------------------------------------------------------------------

    def wait_for(self, keys: list[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` (full names) is set, at most ``timeout``
        seconds; whether they are. One request, however many keys.

        The wait holds the worker's store connection (torch's client sends one request at
        a time): another store request of this worker waits behind it. The start-up gates
        use it (nothing else of the worker needs the store then); a second connection
        would not queue, but a thousand workers opening one each at once is what the
        store serves worst (a burst of connections is answered in seconds).

        Raises:
            RuntimeError, OSError: the store is unreachable.
        """
        if not hasattr(self.store.inner, "wait"):
            return _poll_until(lambda: self.store.check(keys), timeout)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(timeout, 0.001)))
        except (RuntimeError, OSError) as exc:
            if timed_out(exc):
                return False
            raise
        return True

    def unset(self, keys: dict[int, str]) -> list[int]:
        """The ranks whose key (full name) is not set, read by halving: one request when
        all are set, about 2 log2(n) per rank missing (never blocks)."""
        ranks = sorted(keys)
        if not ranks:
            return []
        if self.store.check([keys[r] for r in ranks]):
            return []
        missing: list[int] = []
        pending = [ranks]
        while pending:  # bounded: each step halves a list, down to single ranks
            part = pending.pop()
            if len(part) == 1:
                missing.append(part[0])
                continue
            half = len(part) // 2
            for piece in (part[:half], part[half:]):
                if not self.store.check([keys[r] for r in piece]):
                    pending.append(piece)
        return sorted(missing)

    # -- barriers --------------------------------------------------------------------------
    # A barrier's arrivals are bits of a few counters: rank r adds 1 << (r % 62) to the
    # counter of block r // 62, one ``add`` that both counts it and says who it is (the
    # value is the block's arrivals). The arrival that fills a block adds one to the
    # counter of full blocks; the one that brings it to N / 62 completed the barrier and
    # sets the "open" key, which waiters check only when no message told them (one key,
    # one request). A dead rank is counted once, by whichever survivor sets its bit first
    # (compare-and-set, only when the bit is clear), so the barrier opens for the
    # survivors; who is missing is the clear bits (one read per block, only when probing).

    def _counter(self, tag: str, block: int) -> str:
        return f"{_PREFIX}barrier/{tag}/{block}"

    def _open_key(self, tag: str) -> str:
        return f"{_PREFIX}barrier/{tag}/open"

    def _full_mask(self, block: int) -> int:
        """Every bit of ``block``'s ranks (static; the last block may be shorter)."""
        assert self.world_size is not None
        count = min(_BLOCK, self.world_size - block * _BLOCK)
        return (1 << count) - 1

    def _blocks_key(self, tag: str) -> str:
        return f"{_PREFIX}barrier/{tag}/blocks"

    def _filled(self, tag: str, block: int, mask: int) -> None:
        """If ``mask`` holds all of ``block``'s ranks (static groups), count the block
        full; the count that fills the last block opens the barrier, here."""
        if self.world_size is None or mask != self._full_mask(block):
            return
        blocks = (self.world_size + _BLOCK - 1) // _BLOCK
        count = self.store.add(self._blocks_key(tag), 1)
        if count & _COUNT_MASK == blocks:
            self.store.set(self._open_key(tag), b"1")
            self.opened_here[tag] = count > _COUNT_MASK

    def arrive(self, tag: str) -> None:
        """Mark this rank as having reached barrier ``tag``: one ``add`` (and one more
        for the arrival that fills its block, one ``set`` for the one that fills the last
        block: ``opened_here`` then holds ``tag``)."""
        block, bit = divmod(self.rank, _BLOCK)
        key = self._counter(tag, block)
        mask = self.store.add(key, 1 << bit)
        if not mask >> bit & 1:
            # The bit was set already: a survivor counted this rank as dead (a false
            # verdict; it is here). The add carried into the next bit: undone.
            mask = self.store.add(key, -(1 << bit))
            return
        self._filled(tag, block, mask)

    def count_dead(self, tag: str, rank: int) -> bool:
        """Count ``rank``, found dead, as arrived at barrier ``tag`` unless it arrived (or
        was counted) already; whether this call counted it. A few requests (rare)."""
        block, bit = divmod(rank, _BLOCK)
        key = self._counter(tag, block)
        # Flagged before the bit is set, so the flag is in the count of full blocks when
        # the last one fills: whoever completes the barrier says some rank died, and only
        # then do the others read the list of the lost (a spare flag costs them a read).
        self.store.add(self._blocks_key(tag), _DEAD_FLAG)
        for _ in range(1000):  # bounded: each failed swap means another rank was counted
            mask = self.store.add(key, 0)
            if mask >> bit & 1:
                return False
            wanted = str(mask | 1 << bit).encode()
            if self.store.compare_set(key, str(mask), wanted) == wanted:
                self._filled(tag, block, mask | 1 << bit)
                return True
        raise RuntimeError(f"could not count rank {rank} at barrier {tag!r}")  # pragma: no cover

    def reach(self, tag: str) -> None:
        """``arrive`` at a shutdown barrier.

        Raises:
            ShutdownError: the store is unreachable (naming the worker that served it).
        """
        self._store_op(lambda: self.arrive(tag))

    def await_arrivals(self, tag: str, ranks: list[int], seconds: float) -> bool:
        """Wait at most ``seconds`` until every rank in ``ranks`` has reached barrier
        ``tag``; whether they have (asked at least once, so ``seconds`` 0 is one look). A
        static group polls the barrier's one "open" key: the ranks left out of ``ranks``
        are the dead, which the caller counted (``count_dead``). A dynamic group polls the
        counters of ``ranks``.

        Raises:
            ShutdownError: the store is unreachable.
        """
        if self.world_size is None:
            return self._store_op(lambda: _poll_until(lambda: not self._clear(tag, ranks), seconds))
        # One key, polled, not a store ``wait``: a wait that returns on an executor
        # thread while the interpreter finalizes aborts the process (Python 3.11 unwinds
        # the thread through torch's C++: std::terminate; ``python -m
        # bench.store_wait_exit``), and a wait holds the worker's one store connection (a
        # member's address read meanwhile queues behind it). The shutdown polls only
        # when no BarrierOpened message came (docs/scale.md).
        key = [self._open_key(tag)]
        return self._store_op(lambda: _poll_until(lambda: self.store.check(key), seconds))

    def _clear(self, tag: str, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose bit is clear: two requests when every block they fall
        in has a counter (``check``, then ``multi_get``, which would wait for a missing
        key), else one read per block."""
        blocks = sorted({r // _BLOCK for r in ranks})
        keys = [self._counter(tag, b) for b in blocks]
        if len(keys) > 1 and self.store.check(keys):
            values = [int(v) for v in self.store.multi_get(keys)]
        else:
            values = [self.store.add(key, 0) for key in keys]
        masks = dict(zip(blocks, values, strict=True))
        return sorted(r for r in ranks if not masks[r // _BLOCK] >> (r % _BLOCK) & 1)

    def missing(self, tag: str, ranks: list[int] | None = None) -> list[int]:
        """Of ``ranks`` (default: every member; in a dynamic group, those listed now),
        those that have not reached barrier ``tag`` yet, nor were counted dead (never
        blocks; one read per block of 62 ranks)."""

        def read() -> list[int]:
            among = ranks if ranks is not None else self.member_ranks()
            return self._clear(tag, among) if among else []

        return self._store_op(read)

    def member_ranks(self) -> list[int]:
        raise NotImplementedError  # StoreGroup's

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` has finished its shutdown (reached the "left" barrier)."""
        return not self._clear("left", [rank])

    def declare_lost(self, rank: int) -> None:
        """Record that this worker found ``rank`` dead while shutting down (also in the
        list ``lost_ranks`` reads)."""

        def record() -> None:
            self.store.set(f"{_PREFIX}lost/{rank}", b"1")
            self.store.append(_LOST_LIST, f"{rank} ")

        self._store_op(record)

    def lost_ranks(self) -> list[int]:
        """The ranks some worker declared dead while shutting down: one request when none
        was. A barrier opens for a worker once the dead were counted by anyone, so a
        survivor reads here those it did not find dead itself."""

        def read() -> list[int]:
            if not self.store.check([_LOST_LIST]):
                return []
            return sorted({int(r) for r in self.store.get(_LOST_LIST).split()})

        return self._store_op(read)

    def declared_lost(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` some worker recorded as dead (never blocks; a request each:
        they are the few still missing, and mostly none is declared)."""
        return self._store_op(
            lambda: [r for r in ranks if self.store.check([f"{_PREFIX}lost/{r}"])]
        )

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
            return ShutdownError(f"the rendezvous store is unreachable: {first_line(exc)}")
        return ShutdownError(
            f"worker {self.host_name!r} (rank 0) is gone: its process served the rendezvous "
            f"store, which no longer answers ({first_line(exc)})"
        )
