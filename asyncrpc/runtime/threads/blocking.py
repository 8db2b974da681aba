"""Who to tell when a thread is about to block on an RPC future (layer L2.01).

A pool thread that waits for a reply (``rpc_sync`` inside a remote function, a nested
``to_here``) holds one of its pool's threads while doing nothing. ``Future.wait`` announces
such waits here; the thread pool that owns the waiting thread (it registers itself when
the thread starts) may then start a stand-in thread, so that nested blocking calls deeper
than the pool never deadlock. Other threads block without telling anybody.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["BlockingHost", "blocking", "set_blocking_host"]


class BlockingHost(Protocol):
    """What a thread's owner (its pool) hears about that thread's blocking waits."""

    def blocking_begin(self) -> None: ...

    def blocking_end(self) -> None: ...


_local = threading.local()


def set_blocking_host(host: BlockingHost | None) -> None:
    """Register (or clear) the owner of the calling thread."""
    _local.host = host


class _Blocking:
    """The context ``blocking()`` returns (a class: cheaper than a generator per wait)."""

    __slots__ = ("_host",)

    def __enter__(self) -> None:
        host: BlockingHost | None = getattr(_local, "host", None)
        self._host = host
        if host is not None:
            host.blocking_begin()

    def __exit__(self, *exc: object) -> None:
        if self._host is not None:
            self._host.blocking_end()


def blocking() -> _Blocking:
    """Wrap a wait of the calling thread that may last (a reply from a peer)."""
    return _Blocking()
