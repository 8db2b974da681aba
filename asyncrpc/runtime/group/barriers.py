"""Store barriers, and the store requests of a graceful shutdown (layer L2).

A barrier is one key per rank, set on arrival. A waiter sends one request that the store
answers once every key it names is set (``wait``): a healthy barrier costs each worker two
requests, whatever the group's size. A wait is cut in slices, so the shutdown can look at
the workers still missing: which ones they are is read by halving (``check`` answers for a
set of keys at once), a few requests when few are missing.
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
# A store without ``wait`` is polled this often.
_POLL_S = 0.05


def timed_out(exc: BaseException) -> bool:
    """Whether a store's ``wait`` failed for its timeout (the store still answers), not
    because the store is gone (torch raises both as RuntimeError subclasses)."""
    if type(exc).__name__ == "DistNetworkError":
        return False
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


class StoreBarriers:
    """The barrier keys of a group's store (a base of ``StoreGroup``)."""

    rank: int
    world_size: int | None
    host_name: str | None

    def __init__(self, store: QuietStore) -> None:
        self.store = store

    # -- waiting ---------------------------------------------------------------------------

    def wait_for(self, keys: list[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` (full names) is set, at most ``timeout``
        seconds; whether they are. One request, however many keys.

        The wait holds the worker's store connection (torch's client sends one request at
        a time): another store request of this worker, a member looked up, waits behind it
        for at most ``timeout``, which is why a shutdown waits in slices of a few seconds.
        A second connection would not queue, but a thousand workers opening one each at
        once is what the store serves worst (a burst of connections is answered in
        seconds).

        Raises:
            RuntimeError, OSError: the store is unreachable.
        """
        if not hasattr(self.store.inner, "wait"):
            return self._poll_for(keys, timeout)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(timeout, 0.001)))
        except (RuntimeError, OSError) as exc:
            if timed_out(exc):
                return False
            raise
        return True

    def _poll_for(self, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):  # bounded by the deadline
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
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

    def _barrier_key(self, tag: str, rank: int) -> str:
        return f"{_PREFIX}barrier/{tag}/{rank}"

    def arrive(self, tag: str) -> None:
        """Mark this rank as having reached barrier ``tag``."""
        self.store.set(self._barrier_key(tag, self.rank), b"1")

    def reach(self, tag: str) -> None:
        """``arrive`` at a shutdown barrier.

        Raises:
            ShutdownError: the store is unreachable (naming the worker that served it).
        """
        self._store_op(lambda: self.arrive(tag))

    def await_arrivals(self, tag: str, ranks: list[int], seconds: float) -> bool:
        """Wait at most ``seconds`` until every rank in ``ranks`` has reached barrier
        ``tag``; whether they have (one request).

        Raises:
            ShutdownError: the store is unreachable.
        """
        keys = [self._barrier_key(tag, r) for r in ranks]
        return self._store_op(lambda: not keys or self.wait_for(keys, seconds))

    def missing(self, tag: str, ranks: list[int] | None = None) -> list[int]:
        """Of ``ranks`` (default: every member; in a dynamic group, those listed now),
        those that have not reached barrier ``tag`` yet (never blocks)."""

        def read() -> list[int]:
            among = ranks if ranks is not None else self.member_ranks()
            return self.unset({r: self._barrier_key(tag, r) for r in among})

        return self._store_op(read)

    def member_ranks(self) -> list[int]:
        raise NotImplementedError  # StoreGroup's

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` has finished its shutdown (reached the "left" barrier)."""
        return bool(self.store.check([self._barrier_key("left", rank)]))

    def declare_lost(self, rank: int) -> None:
        """Record that this worker found ``rank`` dead while shutting down."""
        self._store_op(lambda: self.store.set(f"{_PREFIX}lost/{rank}", b"1"))

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
