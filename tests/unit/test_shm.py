"""Unit tests of the shared-memory arena and of both sides of SharedMemory, in one process.

No event loop: the loop is a stand-in that records what would be scheduled on it, and this
process plays both sender and receiver (it can open its own memfds through /proc).
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire.messages import ShmMessage, ShmOp, decode_message
from asyncrpc.runtime.shm.arena import SharedArena, size_class
from asyncrpc.runtime.shm.shm import SharedMemory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd and /proc are Linux's")

MIB = 1 << 20


class _Loop:
    """Records ``call_soon_threadsafe`` calls; ``run`` runs them in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_size_class_rounds_to_powers_of_two_with_a_floor() -> None:
    assert size_class(1) == 64 << 10
    assert size_class(MIB) == MIB
    assert size_class(MIB + 1) == 2 * MIB
    assert size_class(3 * MIB) == 4 * MIB


def test_SharedArena_reuses_a_released_chunk_and_ignores_foreign_releases() -> None:
    arena = SharedArena(8 * MIB)
    first = arena.lend(1, MIB)
    assert first is not None
    assert arena.lent_bytes == MIB
    second = arena.lend(1, MIB)  # the first is still lent: a new chunk
    assert second is not None
    assert second.id != first.id
    arena.release(2, [first.id])  # not rank 2's to give back
    assert arena.lent_bytes == 2 * MIB
    arena.release(1, [first.id, 999])  # an unknown id is ignored
    assert arena.lent_bytes == MIB
    again = arena.lend(3, MIB - 100)
    assert again is first
    assert again.lent_to == 3
    arena.close()


def test_SharedArena_full_arena_evicts_free_chunks_then_refuses() -> None:
    arena = SharedArena(2 * MIB)
    a = arena.lend(1, MIB)
    b = arena.lend(1, MIB)
    assert a is not None
    assert b is not None
    assert arena.lend(1, MIB) is None
    assert arena.fallbacks == 1
    arena.release(1, [a.id])
    big = arena.lend(1, 2 * MIB)  # needs both: only the free one can go
    assert big is None
    assert arena.fallbacks == 2
    c = arena.lend(1, 512 << 10)  # a free 1 MiB chunk is closed to make room
    assert c is not None
    assert arena.total_bytes <= 2 * MIB
    assert arena.take_retired() == {1: [a.id]}  # rank 1 had mapped it
    assert arena.take_retired() == {}
    assert arena.lend(1, 4 * MIB) is None  # larger than the whole arena
    arena.close()


def test_SharedArena_orphan_closes_what_a_lost_peer_holds() -> None:
    arena = SharedArena(8 * MIB)
    held = arena.lend(1, MIB)
    other = arena.lend(2, MIB)
    assert held is not None
    assert other is not None
    assert arena.orphan(1) == 1
    assert held.array is None
    assert arena.lent_bytes == MIB
    assert arena.lent_to(1) == 0
    arena.release(1, [held.id])  # late release from before the loss: ignored
    assert arena.lent_bytes == MIB
    fresh = arena.lend(1, MIB)
    assert fresh is not None
    assert fresh.id not in (held.id, other.id)
    arena.close()
    assert arena.lend(1, MIB) is None


def _pair(threshold: int = 256 << 10) -> tuple[SharedMemory, SharedMemory, list[Any], _Loop]:
    """A sender (rank 0) and a receiver (rank 1) in this process, after the probe."""
    loop = _Loop()
    wire: list[Any] = []  # (from, to, message)
    sides: dict[int, SharedMemory] = {}

    def sender_of(me: int) -> Any:
        def send(rank: int, pieces: list[Any], connect: bool) -> None:
            del connect
            header = bytes(pieces[0])[24:]
            import msgpack

            fields = msgpack.unpackb(header)[:-1]
            wire.append((me, rank, decode_message(fields)))

        return send

    for rank in (0, 1):
        sides[rank] = SharedMemory(loop, threshold, 64 * MIB, lambda r: True, sender_of(rank))
    serializer = Serializer(place=sides[0].place)
    serializer.dumps(torch.ones(MIB), context=1)  # the first large segment probes
    loop.run()
    ((frm, to, offer),) = wire
    assert (frm, to, offer.op) == (0, 1, ShmOp.OFFER)
    assert offer.values[0] == os.getpid()
    sides[1].on_message(0, offer)
    (_, _, answer) = wire[-1]
    assert answer == ShmMessage(ShmOp.ANSWER, (1,))
    sides[0].on_message(1, answer)
    wire.clear()
    return sides[0], sides[1], wire, loop


def _deliver(
    sender: SharedMemory, receiver: SharedMemory, value: object
) -> tuple[Any, list[object]]:
    serializer = Serializer(place=sender.place)
    payload, segments, keep, _ = serializer.dumps(value, context=1)
    owners = [
        receiver.allocate(0, len(view), tag)[0] if tag.startswith("shm:") else bytes(view)
        for view, tag in segments
    ]
    del keep
    return Serializer().loads(payload, owners), owners


def test_SharedMemory_moves_large_segments_and_gets_chunks_back() -> None:
    sender, receiver, wire, loop = _pair()
    big = torch.randn(512, 512)  # 1 MiB
    value, owners = _deliver(sender, receiver, {"big": big.t(), "small": torch.ones(4)})
    assert torch.equal(value["big"], big.t())
    assert value["big"].stride() == big.t().stride()
    assert sender.stats()["shm_lent_bytes"] == MIB
    assert receiver.segments_received == 1
    del value, owners
    gc.collect()
    loop.run()  # the receiver's release is flushed on the loop
    ((_, to, release),) = wire
    assert to == 0
    assert release.op == ShmOp.RELEASE
    sender.on_message(1, release)
    assert sender.stats()["shm_lent_bytes"] == 0
    sender.close()
    receiver.close()


def test_SharedMemory_small_segments_and_unprobed_peers_stay_on_the_socket() -> None:
    sender, receiver, _, _ = _pair(threshold=2 * MIB)
    serializer = Serializer(place=sender.place)
    _, segments, _, _ = serializer.dumps(torch.ones(MIB // 4), context=1)  # under the threshold
    assert not segments[0][1].startswith("shm:")
    _, segments, _, _ = serializer.dumps(torch.ones(MIB), context=5)  # rank 5 never probed
    assert not segments[0][1].startswith("shm:")
    _, segments, _, _ = serializer.dumps(torch.ones(MIB), context=None)  # not a peer
    assert not segments[0][1].startswith("shm:")
    sender.close()
    receiver.close()


def test_SharedMemory_leaves_segments_bound_for_a_cuda_device_on_the_socket() -> None:
    # A staged CUDA segment's bytes are still being copied from the GPU when the message is
    # pickled; copied into shared memory then, the peer would read stale bytes (seen on an
    # H100). It must stay as it is, to be written after the frame's ready stage.
    sender, receiver, _, _ = _pair()
    staged = torch.zeros(MIB, dtype=torch.uint8)
    view = _view_of(staged)
    host = torch.ones(MIB, dtype=torch.uint8)
    segments = [(view, "cuda:0"), (_view_of(host), "cpu")]
    placed = sender.place(segments, [staged, host], 1)
    assert placed[0] == segments[0]
    assert placed[0][0] is view
    assert placed[1][1].startswith("shm:")  # a host segment of the same message still goes
    sender.close()
    receiver.close()


def _view_of(tensor: torch.Tensor) -> memoryview:
    from asyncrpc.protocol.serde.tensors import memory_view

    return memory_view(tensor.data_ptr(), tensor.numel() * tensor.element_size(), writable=False)


def test_SharedMemory_refuses_offers_it_cannot_verify() -> None:
    loop, answers = _Loop(), []
    side = SharedMemory(loop, 1, MIB, lambda r: r != 7, lambda r, p, c: answers.append(p))
    fd = os.memfd_create("probe")
    stat = os.fstat(fd)
    try:
        for values in (
            (os.getpid(), fd, stat.st_dev, stat.st_ino + 1),  # another file at that fd
            (os.getpid(), 10_000, stat.st_dev, stat.st_ino),  # no such fd
            (2**22 + 12345, fd, stat.st_dev, stat.st_ino),  # no such process
            (os.getpid(), fd, stat.st_dev),  # malformed
        ):
            assert not side._accept(3, values)
        assert not side._accept(7, (os.getpid(), fd, stat.st_dev, stat.st_ino))  # not eligible
        assert side._accept(3, (os.getpid(), fd, stat.st_dev, stat.st_ino))
    finally:
        os.close(fd)
        side.close()


def test_SharedMemory_bad_segments_fail_the_message_not_the_connection() -> None:
    sender, receiver, wire, loop = _pair()
    serializer = Serializer(place=sender.place)
    payload, segments, _, _ = serializer.dumps(torch.ones(MIB // 4), context=1)
    tag = segments[0][1]
    fd, chunk_id, size, dev, ino, nbytes, device = tag.split(":", 7)[1:]
    for bad_tag, rank in (
        ("shm:x", 0),  # malformed
        (tag, 2),  # from a peer whose memory we never agreed to map
        (":".join(["shm", fd, chunk_id, size, dev, str(int(ino) + 1), nbytes, device]), 0),
        (":".join(["shm", fd, chunk_id, size, dev, ino, str(int(size) + 1), device]), 0),
    ):
        owner, view = receiver.allocate(rank, 0, bad_tag)
        assert isinstance(owner, SerializationError)
        assert len(view) == 0
        with pytest.raises(SerializationError):
            Serializer().loads(payload, [owner])
    loop.run()
    released = [m.values for frm, to, m in wire if m.op == ShmOp.RELEASE]
    assert released
    assert int(chunk_id) in released[0]
    sender.close()
    receiver.close()


def test_SharedMemory_lost_peer_drops_mappings_and_ignores_late_releases() -> None:
    sender, receiver, wire, loop = _pair()
    value, owners = _deliver(sender, receiver, torch.ones(MIB // 4))
    receiver.on_peer_lost(0)
    sender.on_peer_lost(1)
    assert sender.stats()["shm_lent_bytes"] == 0
    assert sender.stats()["shm_peers"] == 0
    assert float(value.sum()) == MIB // 4  # the mapping outlives the arrangement
    del value, owners
    gc.collect()
    loop.run()
    assert not wire  # a release from before the loss is not sent
    sender.close()
    receiver.close()
