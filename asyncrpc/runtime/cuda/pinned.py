"""Pinned host buffers for staged CUDA copies: a pool bounded in bytes, reused (layer L2.45).

A staged tensor is copied from its device into a pinned host buffer lent by this pool; the
frame's segment is a view of it. The buffer comes back to the pool when the last tensor
over it is freed (the serializer's host tensor and the frame's keepalive: the same rule
that keeps any zero-copy segment valid until the transport is done with it), and it is
lent again only once the copy that last filled it is done on its stream, so a frame
dropped before its copy finished cannot have a stale copy land in the next one's bytes.

Bound: the pool owns at most ``limit`` bytes of blocks (sizes rounded up to a power of two
from ``MIN_BLOCK``). A request that fits in no free block and whose new block would pass
the bound first drops free blocks of other sizes; if the lent ones alone leave no room, it
gets a fresh buffer outside the pool (``fresh``), which goes back to the seam's allocator
(torch's caching host allocator on a GPU) when freed. It never waits: ``lend`` runs on
the thread that pickles a message, which must not block.

Threads: ``lend`` runs on whichever thread pickles; a block comes back on whichever thread
freed its last tensor. The tables sit behind a (reentrant) lock.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from asyncrpc.protocol.serde.tensors import memory_view
from asyncrpc.runtime.cuda.devices import Devices, Event

__all__ = ["MIN_BLOCK", "PINNED_POOL_BYTES", "PinnedPool"]

# 512 MiB lets two 256 MiB tensors (the largest echo the bench sends) be staged at once
# (the default of RpcBackendOptions.cuda_pinned_pool_bytes; a test keeps them equal).
PINNED_POOL_BYTES = 512 << 20
MIN_BLOCK = 64 << 10  # small tensors share 64 KiB blocks' size class


@dataclass(eq=False)
class _Block:
    base: Any  # the seam's flat uint8 pinned tensor (None until allocated)
    size: int
    fill: Event | None = None  # the last copy into it; not lent again before it is done


class PinnedPool:
    def __init__(self, devices: Devices, limit: int = PINNED_POOL_BYTES) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 bytes, got {limit}")
        self._devices = devices
        self.limit = limit
        self._free: dict[int, list[_Block]] = {}  # by size class
        # Reentrant: a block may come back (a finalizer) in a garbage collection that runs
        # while this thread holds the lock.
        self._lock = threading.RLock()
        self.pooled = 0  # bytes of blocks the pool owns, lent or free
        self.lent = 0  # blocks out now
        self.made = 0  # blocks allocated for the pool, reused, dropped, and lends outside it
        self.reused = 0
        self.dropped = 0
        self.fresh = 0

    def lend(self, nbytes: int) -> tuple[Any, _Block | None]:
        """A flat uint8 pinned CPU tensor of exactly ``nbytes`` (> 0), and the pool's block
        under it (None: a fresh buffer outside the pool). Give the block the event of the
        last copy into it with ``filled``; it comes back when the tensor (and every view
        of it) is freed. Never waits."""
        size = _size_class(nbytes)
        with self._lock:
            block = self._reuse(size) or self._make(size)
            if block is None:
                self.fresh += 1
            else:
                self.lent += 1
        if block is None:
            return self._devices.host_buffer(nbytes), None
        if block.base is None:  # made just now: allocated off the lock (pinning is slow)
            block.base = self._devices.host_buffer(size)
        view = memory_view(block.base.data_ptr(), nbytes, writable=True)
        # The tensor's storage holds `view`; once the last tensor over it is freed, `view`
        # goes, and the block with it back to the free list.
        weakref.finalize(view, self._returned, block).atexit = False
        return torch.frombuffer(view, dtype=torch.uint8), block

    def filled(self, block: _Block | None, event: Event) -> None:
        """``event`` completes after the last copy queued into ``block``."""
        if block is not None:
            block.fill = event

    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.size for blocks in self._free.values() for b in blocks)

    def stats(self) -> dict[str, int]:
        return {
            "cuda_pinned_bytes": self.pooled,
            "cuda_pinned_lent": self.lent,
            "cuda_pinned_made": self.made,
            "cuda_pinned_reused": self.reused,
            "cuda_pinned_fresh": self.fresh,
        }

    def _reuse(self, size: int) -> _Block | None:
        # Under the lock: a free block of this size whose last copy is done.
        blocks = self._free.get(size, [])
        for i, block in enumerate(blocks):
            if block.fill is None or self._devices.done(block.fill):
                self.reused += 1
                return blocks.pop(i)
        return None

    def _make(self, size: int) -> _Block | None:
        # Under the lock: a new block within the bound, dropping free blocks of other
        # sizes (whose copies are done) to make room; None when the lent ones fill it.
        if self.pooled + size > self.limit:
            for other in sorted(self._free, key=lambda s: -s):  # the largest go first
                blocks = self._free[other]
                for block in list(blocks):
                    if self.pooled + size <= self.limit:
                        break
                    if block.fill is None or self._devices.done(block.fill):
                        blocks.remove(block)
                        self.pooled -= block.size
                        self.dropped += 1
        if self.pooled + size > self.limit:
            return None
        self.pooled += size
        self.made += 1
        return _Block(None, size)

    def _returned(self, block: _Block) -> None:
        with self._lock:
            self.lent -= 1
            self._free.setdefault(block.size, []).append(block)


def _size_class(nbytes: int) -> int:
    return max(MIN_BLOCK, 1 << (nbytes - 1).bit_length())
