"""Shared memory between workers on one host: large tensor segments skip the socket (L2).

The sender copies a large segment once into a chunk of its arena (``arena.py``) and sends,
in place of the bytes, a tag naming the chunk. The receiver maps the chunk (opening the
sender's memfd through ``/proc/<pid>/fd``, once per chunk: the mapping is cached), builds
the tensor on it without a copy, and sends the chunk's id back (RELEASE) when the last
tensor using that memory dies. Control frames and small segments stay on the connection.

That a peer can map our memory is learnt, not assumed: the first large segment for a peer
on this host travels over the socket while an OFFER names a probe file; the peer answers
whether it opened it and found the very same file (device and inode), which also rules out
a peer in another PID namespace. A lost connection ends the arrangement on both sides:
chunks lent to that peer are closed rather than reused (it may still read them), and the
peer drops its mappings; a later connection probes again.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde.tensors import Segment
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import ShmMessage, ShmOp
from asyncrpc.runtime.shm.arena import SharedArena

__all__ = ["SHM_TAG_PREFIX", "SharedMemory", "segment_nbytes"]

SHM_TAG_PREFIX: Final = "shm:"
_EMPTY: Final = memoryview(bytearray())  # what a shared segment asks the wire to receive
_UINT8: Final = torch.uint8
_memmove: Final = ctypes.memmove  # a CFUNCTYPE: it releases the GIL while it copies

# A segment bound for a CUDA device is staged: its bytes are still being copied from the GPU
# while the message is pickled, and are valid only once the frame's ready stage (the
# copies' events) has passed. Copying it into shared memory here would send whatever the
# pinned buffer held before, so it stays on the socket, written after that stage.
_DEVICE_TAG: Final = "cuda"

# What this side knows of a peer as a receiver of our chunks.
_UNKNOWN, _PROBING, _ON, _OFF = 0, 1, 2, 3


class _Lease:
    """The chunks one frame borrowed; returned at once if the frame is never written."""

    __slots__ = ("ids", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ids: list[int] = []


class _Sender:
    """A peer whose chunks we map: its pid and our mappings of its chunks, newest last."""

    __slots__ = ("epoch", "mapped_bytes", "maps", "pid")

    def __init__(self, pid: int, epoch: int) -> None:
        self.pid = pid
        self.epoch = epoch
        self.maps: collections.OrderedDict[int, memoryview] = collections.OrderedDict()
        self.mapped_bytes = 0


class SharedMemory:
    """Both sides of shared-memory transfer for one worker.

    Args:
        loop: the agent's event loop (RELEASE and RETIRE are sent from it).
        threshold: segments of at least this many bytes travel through shared memory.
        capacity: bytes of chunks this worker lends at most (also what it maps, per peer).
        eligible: whether a rank may share memory with us at all (same host, options).
        send: ``send(rank, pieces, connect)`` writes a control frame to a rank if it is
            connected, or connecting first when ``connect`` (loop thread only).
    """

    def __init__(
        self,
        loop: Any,
        threshold: int,
        capacity: int,
        eligible: Callable[[int], bool],
        send: Callable[[int, list[Any], bool], None],
    ) -> None:
        self._loop = loop
        self._threshold = max(threshold, 1)
        self._capacity = capacity
        self._eligible = eligible
        self._send = send
        self._arena = SharedArena(capacity)
        self._state: dict[int, int] = {}  # rank -> _UNKNOWN.. as a receiver of our chunks
        self._senders: dict[int, _Sender] = {}  # ranks whose chunks we may map
        self._epochs = 0
        self._probe_fd = -1
        self._lock = threading.Lock()  # guards _releases and _flush_scheduled
        self._releases: dict[int, list[int]] = {}
        self._flush_scheduled = False
        self._closed = False
        self.segments_sent = 0
        self.bytes_sent = 0
        self.segments_received = 0

    # -- sending ---------------------------------------------------------------------------

    def place(
        self, segments: list[Segment], keepalive: list[object], context: object
    ) -> list[Segment]:
        """The serializer's ``Place`` hook: large segments for ``context`` (a rank) go shared."""
        state = self._state.get(context, _UNKNOWN) if type(context) is int else _OFF
        if state in (_OFF, _PROBING):
            return segments
        threshold = self._threshold
        placed: list[Segment] | None = None
        lease: _Lease | None = None
        for index, (view, tag) in enumerate(segments):
            nbytes = len(view)
            if nbytes < threshold or tag.startswith(_DEVICE_TAG):
                continue
            if state == _UNKNOWN:
                self._want_probe(context)  # type: ignore[arg-type]  # an int: checked above
                return segments
            if lease is None:
                lease = _Lease(context)  # type: ignore[arg-type]
            shared = self._copy_in(lease, nbytes, tag, keepalive[index])
            if shared is not None:
                if placed is None:
                    placed = list(segments)
                placed[index] = shared
        if lease is not None and lease.ids:
            keepalive.append(lease)
        return segments if placed is None else placed

    def _copy_in(self, lease: _Lease, nbytes: int, tag: str, source: object) -> Segment | None:
        """Copy one segment into a chunk lent to the lease's rank; None: use the socket."""
        try:
            chunk = self._arena.lend(lease.rank, nbytes)
        except OSError:
            return None  # out of memory or descriptors: the socket still works
        if chunk is None:
            return None
        array = chunk.array
        if array is None:  # orphaned meanwhile (the peer's connection was lost)
            return None
        assert isinstance(source, torch.Tensor)
        # memmove, not copy_: one predictable copy without the GIL. torch's copy_ splits
        # the work over its intra-op threads, and on a loaded host their barrier waits
        # made it 5-10x slower (16 MiB: 0.7 ms memmove, 4-8 ms copy_ next to a busy core).
        # ``array`` is held across the copy, so a concurrent close cannot unmap it.
        _memmove(array.data_ptr(), source.data_ptr(), nbytes)
        lease.ids.append(chunk.id)
        self.segments_sent += 1
        self.bytes_sent += nbytes
        return _EMPTY, chunk.tag(nbytes, tag)

    def unlend(self, keepalive: object) -> None:
        """A frame was dropped before it was written: its chunks go back to the arena."""
        if type(keepalive) is list and keepalive and type(keepalive[-1]) is _Lease:
            lease = keepalive.pop()
            self._arena.release(lease.rank, lease.ids)

    def _want_probe(self, rank: int) -> None:
        # Any thread: the dict write is atomic; a rare second probe is harmless.
        if self._state.get(rank, _UNKNOWN) == _UNKNOWN:
            self._state[rank] = _PROBING
            self._loop.call_soon_threadsafe(self._probe, rank)

    def _probe(self, rank: int) -> None:
        if self._closed or self._state.get(rank) != _PROBING:
            return
        if not self._eligible(rank):
            self._state[rank] = _OFF
            return
        try:
            if self._probe_fd < 0:
                self._probe_fd = os.memfd_create("asyncrpc-probe", os.MFD_CLOEXEC)
            stat = os.fstat(self._probe_fd)
        except OSError:
            self._state[rank] = _OFF
            return
        offer = (os.getpid(), self._probe_fd, stat.st_dev, stat.st_ino)
        # In order behind the frame that made us probe, which may still wait for a connection.
        self._send(rank, _shm_frame(ShmOp.OFFER, offer), True)

    # -- receiving -------------------------------------------------------------------------

    def allocate(self, rank: int | None, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """The wire's allocator for a shared segment: a uint8 tensor on the mapped chunk.

        A segment that cannot be mapped yields an exception as its owner, so that only the
        message using it fails (with ``SerializationError``), not the connection.
        """
        try:
            fd, chunk_id, size, dev, ino, length, _ = _parse_tag(tag)
        except ValueError:
            return SerializationError(f"malformed shared-memory segment tag {tag!r:.80}"), _EMPTY
        sender = self._senders.get(rank) if rank is not None else None
        if sender is None or nbytes or length > size:
            self._queue_release(rank, chunk_id, None)
            return SerializationError(f"unexpected shared-memory segment {tag!r:.80}"), _EMPTY
        view = sender.maps.get(chunk_id)
        if view is None:
            try:
                view = self._map(sender, fd, chunk_id, size, dev, ino)
            except (OSError, ValueError) as exc:
                self._queue_release(rank, chunk_id, sender.epoch)
                return SerializationError(f"shared memory of chunk {chunk_id}: {exc}"), _EMPTY
        else:
            sender.maps.move_to_end(chunk_id)
        owner = torch.frombuffer(view[:length], dtype=_UINT8)
        # The storage object outlives every view of it (torch keeps one Python object per
        # storage), so this runs when the last tensor on the chunk dies, on that thread.
        released = weakref.finalize(
            owner.untyped_storage(), self._queue_release, rank, chunk_id, sender.epoch
        )
        released.atexit = False  # a process that is ending has nobody to tell
        self.segments_received += 1
        return owner, _EMPTY

    def _map(
        self, sender: _Sender, fd: int, chunk_id: int, size: int, dev: int, ino: int
    ) -> memoryview:
        handle = _open_file_of(sender.pid, fd, dev, ino, size, writable=True)
        try:
            region = mmap.mmap(handle, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(handle)
        view = memoryview(region)
        sender.maps[chunk_id] = view
        sender.mapped_bytes += size
        while sender.mapped_bytes > self._capacity and len(sender.maps) > 1:
            # Bound what we map: forgetting a mapping only costs mapping it again.
            _, old = sender.maps.popitem(last=False)
            sender.mapped_bytes -= len(old)
        return view

    def _queue_release(self, rank: int | None, chunk_id: int, epoch: int | None) -> None:
        """Tell ``rank`` that ``chunk_id`` is free again (any thread, batched per loop pass)."""
        if rank is None or self._closed:
            return
        with self._lock:
            sender = self._senders.get(rank)
            if epoch is not None and (sender is None or sender.epoch != epoch):
                return  # from before a lost connection: the sender closed that chunk
            self._releases.setdefault(rank, []).append(chunk_id)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            releases, self._releases = self._releases, {}
            self._flush_scheduled = False
        if self._closed:
            return
        for rank, ids in releases.items():
            self._send(rank, _shm_frame(ShmOp.RELEASE, tuple(ids)), False)
        self._send_retired()

    # -- control messages ------------------------------------------------------------------

    def on_message(self, rank: int, message: ShmMessage) -> None:
        """Handle a SHM message from ``rank`` (loop thread)."""
        op, values = message.op, message.values
        if op == ShmOp.OFFER:
            accepted = self._accept(rank, values)
            self._send(rank, _shm_frame(ShmOp.ANSWER, (int(accepted),)), False)
        elif op == ShmOp.ANSWER:
            if self._state.get(rank) == _PROBING:
                self._state[rank] = _ON if values == (1,) else _OFF
        elif op == ShmOp.RELEASE:
            self._arena.release(rank, values)
            self._send_retired()
        elif op == ShmOp.RETIRE:
            sender = self._senders.get(rank)
            if sender is not None:
                for chunk_id in values:
                    view = sender.maps.pop(chunk_id, None)
                    if view is not None:
                        sender.mapped_bytes -= len(view)

    def _send_retired(self) -> None:
        # Chunks the arena closed to make room (on any thread); said on the loop's next turn.
        for rank, ids in self._arena.take_retired().items():
            self._send(rank, _shm_frame(ShmOp.RETIRE, tuple(ids)), False)

    def _accept(self, rank: int, values: tuple[int, ...]) -> bool:
        """Can we map ``rank``'s memory? Open its probe file and check it is that file."""
        if len(values) != 4 or self._closed or not self._eligible(rank):
            return False
        pid, fd, dev, ino = values
        try:
            os.close(_open_file_of(pid, fd, dev, ino, 0))
        except (OSError, ValueError):
            return False
        with self._lock:
            self._epochs += 1
            self._senders[rank] = _Sender(pid, self._epochs)
        return True

    def on_peer_lost(self, rank: int) -> None:
        """The connection to ``rank`` is gone: end sharing with it both ways (loop thread)."""
        self._state.pop(rank, None)
        self._arena.orphan(rank)
        with self._lock:
            self._senders.pop(rank, None)
            self._releases.pop(rank, None)

    def close(self) -> None:
        """Close the arena and drop every mapping (tensors still alive keep theirs)."""
        self._closed = True
        self._arena.close()
        with self._lock:
            self._senders.clear()
            self._releases.clear()
        if self._probe_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._probe_fd)
            self._probe_fd = -1

    def stats(self) -> dict[str, int]:
        """Gauges and counters for the agent's metrics."""
        return {
            "shm_peers": sum(1 for s in self._state.values() if s == _ON),
            "shm_segments_sent": self.segments_sent,
            "shm_bytes_sent": self.bytes_sent,
            "shm_segments_received": self.segments_received,
            "shm_fallbacks": self._arena.fallbacks,
            "shm_arena_bytes": self._arena.total_bytes,
            "shm_lent_bytes": self._arena.lent_bytes,
            "shm_mapped_bytes": sum(s.mapped_bytes for s in list(self._senders.values())),
        }


def _shm_frame(op: ShmOp, values: tuple[int, ...]) -> list[Any]:
    return encode_frame(ShmMessage(op, values).to_fields(), b"")


def _open_file_of(
    pid: int, fd: int, dev: int, ino: int, min_size: int, *, writable: bool = False
) -> int:
    """Open the file behind another process's ``fd``, checked to be the one it named.

    Returns:
        Our own descriptor of it (the caller closes it).

    Raises:
        OSError: no such process or descriptor, or no right to open it.
        ValueError: another file (device, inode) or a smaller one than ``min_size``.
    """
    path = f"/proc/{pid}/fd/{fd}"
    handle = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        stat = os.fstat(handle)
        if (stat.st_dev, stat.st_ino) != (dev, ino) or stat.st_size < min_size:
            raise ValueError(f"{path} is not the file the sender named")
    except BaseException:
        os.close(handle)
        raise
    return handle


def segment_nbytes(view: memoryview, tag: str) -> int:
    """The bytes a segment to be sent stands for: its own, or for one placed in shared
    memory (an empty view) those its tag names, which hold a chunk of the arena until the
    receiver lets go of them. Stream credit counts these (``calls/streams/producer.py``)."""
    if tag.startswith(SHM_TAG_PREFIX):
        return _parse_tag(tag)[5]
    return memoryview(view).nbytes


def _parse_tag(tag: str) -> tuple[int, int, int, int, int, int, str]:
    """``shm:fd:id:size:dev:ino:nbytes:tag`` -> its fields (ValueError when malformed)."""
    parts = tag.split(":", 7)
    if len(parts) != 8:
        raise ValueError(tag)
    fd, chunk_id, size, dev, ino, nbytes = (int(p) for p in parts[1:7])
    if min(fd, chunk_id, size, dev, ino, nbytes) < 0:
        raise ValueError(tag)
    return fd, chunk_id, size, dev, ino, nbytes, parts[7]
