"""The sending side of shared memory: a bounded pool of memfd chunks lent to peers (L2).

A large segment for a peer on this host is copied once into a chunk, and the chunk is lent
to that peer until it says the tensor built on it is gone (see ``asyncrpc/runtime/shm/shm.py``).
Chunks are ``memfd`` files: nothing ever appears in ``/dev/shm``, and the memory goes back
to the system when the last process holding the file or a mapping of it lets go, SIGKILL
included. Free chunks are kept, by size class, and reused: a reused chunk is already
faulted in on both sides, which is most of what makes shared memory fast here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Final

import torch

__all__ = ["Chunk", "SharedArena", "size_class"]

_PAGE: Final = mmap.PAGESIZE
_MIN_CHUNK: Final = 64 << 10


def size_class(nbytes: int) -> int:
    """The chunk size a segment of ``nbytes`` gets: the next power of two (64 KiB at least).

    Powers of two let chunks be reused for any segment of about the same size; the rounding
    costs address space, not memory (pages past the segment are never touched).
    """
    return max(1 << (nbytes - 1).bit_length(), _MIN_CHUNK)


class Chunk:
    """One memfd file, mapped here; lent to one peer at a time."""

    __slots__ = ("array", "dev", "fd", "id", "ino", "lent_to", "mapped_by", "region", "size")

    def __init__(self, chunk_id: int, size: int) -> None:
        self.id = chunk_id
        self.size = size
        # The name shows in /proc/<pid>/maps of every process mapping it: whose, which.
        self.fd = os.memfd_create(f"asyncrpc-{os.getpid()}-{chunk_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.region = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        stat = os.fstat(self.fd)
        self.dev, self.ino = stat.st_dev, stat.st_ino
        # The copy target: torch copies with its own threads and without the GIL.
        self.array: torch.Tensor | None = torch.frombuffer(self.region, dtype=torch.uint8)
        self.lent_to = -1
        self.mapped_by: set[int] = set()  # peers that mapped it (they unmap when retired)

    def tag(self, nbytes: int, tag: str) -> str:
        """The segment tag that tells a receiver where ``nbytes`` of this chunk's bytes are."""
        return f"shm:{self.fd}:{self.id}:{self.size}:{self.dev}:{self.ino}:{nbytes}:{tag}"

    def close(self) -> None:
        """Unmap and close; a mapping of it in another process keeps its memory alive."""
        self.array = None  # the only export of the region: closing needs none left
        with contextlib.suppress(BufferError):  # a stray view: the mapping goes with it
            self.region.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SharedArena:
    """Chunks of shared memory, at most ``capacity`` bytes of them; thread-safe.

    ``lend`` is called by whichever thread pickles a message (a caller, a pool thread, the
    loop); the lock guards bookkeeping only, never a copy or a system call.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._chunks: dict[int, Chunk] = {}
        self._free: dict[int, list[Chunk]] = {}  # by size; most recently freed last
        self._next_id = 1
        self._bytes = 0  # chunks made or reserved
        self._lent = 0
        self._retired: dict[int, list[int]] = {}  # peer -> ids of chunks it mapped, now closed
        self._closed = False
        self.fallbacks = 0  # segments that found no room and went over the socket

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def lent_bytes(self) -> int:
        return self._lent

    def lent_to(self, rank: int) -> int:
        """How many chunks ``rank`` holds."""
        with self._lock:
            return sum(1 for c in self._chunks.values() if c.lent_to == rank)

    def lend(self, rank: int, nbytes: int) -> Chunk | None:
        """A chunk of at least ``nbytes`` lent to ``rank``, or None when the arena is full.

        Raises:
            OSError: a new chunk could not be made (the caller sends over the socket).
        """
        size = size_class(nbytes)
        with self._lock:
            if self._closed:
                return None
            free = self._free.get(size)
            chunk = free.pop() if free else None
            if chunk is None:
                if not self._reserve(size):
                    self.fallbacks += 1
                    return None
                chunk_id = self._next_id
                self._next_id += 1
            else:
                chunk.lent_to = rank
                self._lent += size
                return chunk
        try:
            chunk = Chunk(chunk_id, size)  # system calls: outside the lock
        except BaseException:
            with self._lock:
                self._bytes -= size
            raise
        with self._lock:
            if self._closed:
                self._bytes -= size
                chunk.close()
                return None
            chunk.lent_to = rank
            self._chunks[chunk_id] = chunk
            self._lent += size
        return chunk

    def _reserve(self, size: int) -> bool:
        """Count ``size`` new bytes in, closing free chunks (oldest first) to make room."""
        if size > self._capacity:
            return False
        for pool in self._free.values():
            while self._bytes + size > self._capacity and pool:
                self._drop(pool.pop(0))
        if self._bytes + size > self._capacity:
            return False
        self._bytes += size
        return True

    def _drop(self, chunk: Chunk) -> None:
        """Close a chunk nobody borrows; peers that mapped it are told to unmap it."""
        del self._chunks[chunk.id]
        self._bytes -= chunk.size
        for rank in chunk.mapped_by:
            self._retired.setdefault(rank, []).append(chunk.id)
        chunk.close()

    def release(self, rank: int, ids: tuple[int, ...] | list[int]) -> None:
        """``rank`` no longer uses these chunks; ids it does not hold are ignored."""
        with self._lock:
            for chunk_id in ids:
                chunk = self._chunks.get(chunk_id)
                if chunk is None or chunk.lent_to != rank:
                    continue  # stale (orphaned meanwhile) or not this peer's to give back
                chunk.lent_to = -1
                chunk.mapped_by.add(rank)
                self._lent -= chunk.size
                self._free.setdefault(chunk.size, []).append(chunk)

    def orphan(self, rank: int) -> int:
        """``rank``'s connection is gone: close what it holds (it may still read it).

        Returns:
            How many chunks were closed.
        """
        with self._lock:
            held = [c for c in self._chunks.values() if c.lent_to == rank]
            for chunk in held:
                self._lent -= chunk.size
                chunk.mapped_by.discard(rank)
                self._drop(chunk)
            for chunk in self._chunks.values():
                chunk.mapped_by.discard(rank)  # its mappings are dropped with the connection
            self._retired.pop(rank, None)
        return len(held)

    def take_retired(self) -> dict[int, list[int]]:
        """Ids of closed chunks to tell each peer about, once."""
        with self._lock:
            retired, self._retired = self._retired, {}
        return retired

    def close(self) -> None:
        """Close every chunk; peers' mappings keep what they still use alive."""
        with self._lock:
            self._closed = True
            chunks = list(self._chunks.values())
            self._chunks.clear()
            self._free.clear()
            self._bytes = self._lent = 0
        for chunk in chunks:
            chunk.close()
