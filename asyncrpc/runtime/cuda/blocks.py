"""Device blocks a producer exports to each same-host peer once and fills per message
(layer L2.45, above the device seam).

Why blocks and not one export per tensor: on an H100 (docs/cuda.md, "What the hardware
settled"), opening another process's memory costs the consumer about 0.7 ms, and letting
go of it waits for the GPU with the GIL held (230 ms behind a busy kernel, the whole
process stopped). So a producer keeps, per peer and device, blocks it exported once; the
peer maps each block once and keeps the mapping while the producer lives. A message's
tensor is copied into a free block on the producer's stream, and the message leaves once
that copy is done (its send gate); the consumer copies the bytes out into memory of its
own, and once that copy is done it names the block back (``ipc.py``'s release notices)
and the block is free for the next message.

Bound: at most ``limit`` bytes of blocks per peer (sizes rounded up to a power of two
from ``MIN_BLOCK``). A message that fits no free block and whose new block would pass the
bound goes staged instead: a block the peer has mapped cannot be given back while the
peer lives (the mapping holds it), so none is dropped to make room.

Threads: ``lend`` runs on whichever thread pickles a message, ``returned`` and
``drop_peer`` on the loop; one lock guards the tables, device calls run outside it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

from asyncrpc.runtime.cuda.devices import Devices, IpcDescriptor

__all__ = ["BLOCK_BYTES_PER_PEER", "MIN_BLOCK", "ExportBlocks", "ExportedBlock"]

MIN_BLOCK = 64 << 10
# Two 256 MiB tensors in flight to one peer at once (the largest echo the CUDA bench
# sends), with room for smaller ones beside them.
BLOCK_BYTES_PER_PEER = 1 << 30


@dataclass(eq=False)
class ExportedBlock:
    id: int
    device: int
    size: int
    memory: Any  # the seam's device buffer: held while the peer may read it
    desc: IpcDescriptor  # what names it to the peer
    named: str = ""  # ``desc`` as the tags carry it (encoded once)
    filled: Any = None  # the event of its last fill: not filled again before it completed
    confirmed: bool = False  # the peer said it opened it (it returned a message's block)


class ExportBlocks:
    """One producer's exported blocks, per peer and device."""

    def __init__(self, devices: Devices, limit: int = BLOCK_BYTES_PER_PEER) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 bytes, got {limit}")
        self._devices = devices
        self.limit = limit
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._free: dict[tuple[int, int, int], list[ExportedBlock]] = {}  # (peer, dev, size)
        self._lent: dict[int, dict[int, ExportedBlock]] = {}  # peer -> id -> block
        self._bytes: dict[int, int] = {}  # peer -> bytes of its blocks, free or lent
        self.made = 0  # blocks exported (metrics)
        self.full = 0  # messages that found no block within the bound (went staged)

    def lend(self, peer: int, device: int, nbytes: int) -> ExportedBlock | None:
        """A block of at least ``nbytes`` on ``device`` for a message to ``peer``, lent
        until ``returned``; None when the bound leaves no room (the message goes staged).

        Raises:
            RuntimeError: the device could not export memory (the message goes staged).
        """
        size = _size_class(nbytes)
        key = (peer, device, size)
        with self._lock:
            free = self._free.get(key, [])
            # The consumer named it back once its copy out was done, which follows the
            # fill its message waited for; a probe's message does not wait, so its fill
            # is asked here (a query: it never blocks).
            for i in range(len(free) - 1, -1, -1):
                block = free[i]
                if block.filled is None or self._devices.done(block.filled):
                    del free[i]
                    self._lent.setdefault(peer, {})[block.id] = block
                    return block
            if self._bytes.get(peer, 0) + size > self.limit:
                self.full += 1
                return None
            self._bytes[peer] = self._bytes.get(peer, 0) + size  # reserved before exporting
        try:
            memory, desc = self._devices.export_block(device, size)
        except BaseException:
            with self._lock:
                self._bytes[peer] -= size
            raise
        block = ExportedBlock(next(self._ids), device, size, memory, desc)
        with self._lock:
            self.made += 1
            self._lent.setdefault(peer, {})[block.id] = block
        return block

    def returned(self, peer: int, ids: list[int], opened: bool = True) -> int:
        """The peer is done with the messages in these blocks: they are free again (and,
        ``opened``, known to be opened there; not so for a message it never read, or one
        never sent). Returns how many were lent to it; others are ignored."""
        count = 0
        with self._lock:
            lent = self._lent.get(peer, {})
            for block_id in ids:
                block = lent.pop(block_id, None) if isinstance(block_id, int) else None
                if block is None:
                    continue
                count += 1
                block.confirmed = block.confirmed or opened
                self._free.setdefault((peer, block.device, block.size), []).append(block)
        return count

    def lent(self, peer: int) -> int:
        """Blocks holding messages ``peer`` has not returned."""
        with self._lock:
            return len(self._lent.get(peer, {}))

    def drop_peer(self, peer: int) -> list[ExportedBlock]:
        """Forget every block of ``peer`` (lost for good); returns them, so the caller can
        drop the references the peer held and collect their memory."""
        with self._lock:
            blocks = list(self._lent.pop(peer, {}).values())
            for key in [k for k in self._free if k[0] == peer]:
                blocks.extend(self._free.pop(key))
            self._bytes.pop(peer, None)
        return blocks

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "cuda_ipc_blocks": self.made,
                "cuda_ipc_block_bytes": sum(self._bytes.values()),
                "cuda_ipc_full": self.full,
            }


def _size_class(nbytes: int) -> int:
    return max(MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())
