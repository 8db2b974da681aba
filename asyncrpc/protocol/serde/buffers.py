"""Receive buffers for large tensors, recycled once the tensors built on them are gone (L1).

A received tensor is built on the memory the socket wrote into, so every large message
needs memory of its own. Fresh memory is expensive to fill: each page faults on first
touch, and on a VM the host may fault it in too (a fresh 64 MiB buffer took 3-44 ms to fill
here, a recycled one ~0). Buffers of ``LARGE_BUFFER_BYTES`` or more are therefore anonymous
mappings in transparent huge pages, kept in a bounded pool and handed out again once no
tensor uses them any more. Smaller buffers come from torch's allocator, which glibc
recycles itself below 32 MiB (its largest dynamic mmap threshold).
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from typing import Final

import torch

from asyncrpc.protocol.serde.tensors import memory_view

__all__ = ["LARGE_BUFFER_BYTES", "ReceiveBuffers"]

LARGE_BUFFER_BYTES: Final = 32 << 20
_HUGE_PAGE: Final = 2 << 20
_HAS_HUGE_PAGES: Final = hasattr(mmap, "MADV_HUGEPAGE")
# The pool's own reference plus getrefcount's argument: a buffer no tensor uses.
_UNUSED_REFS: Final = 2


class ReceiveBuffers:
    """A bounded pool of large receive buffers (used from the agent's loop thread).

    A buffer is an ``mmap``; a tensor made with ``torch.frombuffer`` holds a reference to
    it for as long as the tensor (or any view of it) lives, so the mapping's reference
    count tells whether a buffer is free again without any hook on the tensor.
    """

    __slots__ = ("_capacity", "_free_scan", "_pooled", "_pooled_bytes")

    def __init__(self, capacity: int = 256 << 20) -> None:
        """Args:
        capacity: bytes of buffers kept for reuse at most; 0 disables the pool.
        """
        self._capacity = capacity
        self._pooled: list[mmap.mmap] = []  # most recently handed out last
        self._pooled_bytes = 0
        self._free_scan = 0

    @property
    def pooled_bytes(self) -> int:
        """Bytes held by the pool, in use or not."""
        return self._pooled_bytes

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes`` (uninitialized: the caller overwrites it)."""
        if nbytes < LARGE_BUFFER_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages: reusable by size
        region = self._reuse(size)
        if region is None:
            region = _new_region(size)
            self._keep(region)
        return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)

    def segment(self, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """The wire's ``Allocator``: an uninitialized uint8 tensor and a writable view of its
        bytes (CPU memory whatever the tag: the bytes arrive over a socket)."""
        del tag
        owner = self.allocate(nbytes)
        return owner, memory_view(owner.data_ptr(), nbytes, writable=True)

    def _reuse(self, size: int) -> mmap.mmap | None:
        pooled = self._pooled
        for index in range(len(pooled)):
            if len(pooled[index]) == size and _unused(pooled, index):
                region = pooled.pop(index)
                pooled.append(region)  # most recently used last: eviction takes the first
                return region
        return None

    def _keep(self, region: mmap.mmap) -> None:
        size = len(region)
        if size > self._capacity:
            return
        pooled = self._pooled
        index = 0
        # Make room by dropping unused buffers, least recently used first.
        while self._pooled_bytes + size > self._capacity and index < len(pooled):
            if _unused(pooled, index):
                self._pooled_bytes -= len(pooled.pop(index))
            else:
                index += 1
        if self._pooled_bytes + size <= self._capacity:
            pooled.append(region)
            self._pooled_bytes += size


def _unused(pooled: list[mmap.mmap], index: int) -> bool:
    """True when no tensor holds ``pooled[index]`` (only the list and the call refer to it)."""
    return sys.getrefcount(pooled[index]) <= _UNUSED_REFS


def _new_region(size: int) -> mmap.mmap:
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HAS_HUGE_PAGES:
        with contextlib.suppress(OSError):  # EINVAL where THP is compiled out: 4 KiB pages
            region.madvise(mmap.MADV_HUGEPAGE)
    return region
