"""Who to tell when a thread is about to block on an RPC future (layer L2).

A pool thread that waits for a reply (``rpc_sync`` inside a remote function, a nested
``to_here``) holds one of its pool's threads while doing nothing. ``Future.wait`` announces
such waits here; the thread pool that owns the waiting thread (it registers itself when
the thread starts) may then start a stand-in thread, so that nested blocking calls deeper
than the pool never deadlock. Other threads block without telling anybody.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
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


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Wrap a wait of the calling thread that may last (a reply from a peer)."""
    host: BlockingHost | None = getattr(_local, "host", None)
    if host is None:
        yield
        return
    host.blocking_begin()
    try:
        yield
    finally:
        host.blocking_end()
