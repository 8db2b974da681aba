"""Chunked staging copies into a bounded, reused pool of pinned buffers, on FakeDevices:
one event per chunk, in order; bytes on the host only once their chunk's copy ran; the
frame held until its last chunk; the pool's bound, reuse, and no growth over 1,000
transfers."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import torch

from asyncrpc.protocol.serde.tensors import memory_view
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.parts import address_of, frame_parts
from asyncrpc.runtime.cuda.pinned import MIN_BLOCK, PinnedPool
from asyncrpc.runtime.cuda.staging import StagedParts, StagedTransfer
from asyncrpc.runtime.net.links import FrameInParts
from tests.fakes import settled
from tests.ordering import until_async

pytestmark = pytest.mark.timeout(10)

MAP = {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}


def source(nbytes: int, seed: int = 1) -> FakeTensor:
    """A contiguous fake device tensor whose bytes are a recognizable pattern."""
    value = bytes((seed + i) % 251 + 1 for i in range(nbytes))
    return FakeTensor(0, value, nbytes=nbytes)


def host_bytes(host: FakeTensor) -> bytes:
    return bytes(host.host.tolist())


# -- chunked copies ----------------------------------------------------------------------


def test_StagedCopy_copies_a_contiguous_tensor_in_chunks_an_event_after_each() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    tensor = source(20)
    _, host = policy.to_host(tensor)
    out = transfer.out_stream(0)
    assert [item.label for item in out.items] == [
        "wait for default0",
        f"copy 0:8 to host on {out.name}",
        f"copy 8:16 to host on {out.name}",
        f"copy 16:20 to host on {out.name}",
    ]
    address = host.host.data_ptr()
    assert [(a - address, b - address) for a, b, _ in policy.chunks] == [(0, 8), (8, 16), (16, 20)]
    assert gpu.records == 1 + 3  # the producer's event, then one per chunk: no extra
    assert policy.events[0] is policy.chunks[-1][2]
    assert transfer.chunked == 3


def test_StagedCopy_chunk_events_complete_in_order_and_bytes_land_only_then() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    gpu.launch(gpu.default_stream(0), "writes the tensor")
    policy = transfer.policy(MAP)
    tensor = source(20)
    _, host = policy.to_host(tensor)
    events = [event for _, _, event in policy.chunks]
    out = transfer.out_stream(0)
    assert host_bytes(host) == bytes(20)  # nothing copied while the producer runs
    gpu.run(out)  # the wait on the producer blocks the copies
    assert [e.done() for e in events] == [False, False, False]
    gpu.run(gpu.default_stream(0))
    gpu.run(out, 2)  # the wait, then the first chunk
    assert [e.done() for e in events] == [True, False, False]
    assert host_bytes(host) == tensor.value[:8] + bytes(12)
    gpu.run(out, 1)
    assert [e.done() for e in events] == [True, True, False]
    assert host_bytes(host)[:16] == tensor.value[:16]
    gpu.run(out)
    assert [e.done() for e in events] == [True, True, True]
    assert host_bytes(host) == tensor.value


@pytest.mark.asyncio
async def test_StagedTransfer_frame_is_held_until_its_last_chunk() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    policy.to_host(source(20))
    out = transfer.out_stream(0)
    ready = asyncio.ensure_future(transfer.ready(policy))  # type: ignore[arg-type]
    gpu.run(out, 3)  # two of three chunks
    assert not await settled(asyncio.shield(ready))
    gpu.run(out)
    assert await settled(ready)


def test_StagedCopy_non_contiguous_tensors_are_copied_whole_outside_the_pool() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    _, host = policy.to_host(FakeTensor(0, "strided"))  # nbytes None: not contiguous
    assert policy.chunks == []
    assert host.value == "strided"
    assert transfer.pinned.made == 0


# -- the pool ----------------------------------------------------------------------------


def test_PinnedPool_reuses_a_block_once_its_tensor_is_freed_and_its_copy_done() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    pool = transfer.pinned
    policy = transfer.policy(MAP)
    _, host = policy.to_host(source(20))
    assert (pool.lent, pool.made) == (1, 1)
    del host, policy
    gc.collect()
    assert pool.lent == 0
    # Freed while its copy is still queued (a dropped frame): not lent again yet.
    second = transfer.policy(MAP)
    _, host = second.to_host(source(20, seed=7))
    assert (pool.made, pool.reused) == (2, 0)
    gpu.run(gpu.default_stream(0))
    gpu.run(transfer.out_stream(0))
    del host, second
    third = transfer.policy(MAP)
    _, host = third.to_host(source(20, seed=9))
    assert (pool.made, pool.reused) == (2, 1)
    gpu.run(transfer.out_stream(0))
    assert host_bytes(host) == source(20, seed=9).value


def test_PinnedPool_keeps_within_its_bound_then_lends_fresh_buffers() -> None:
    gpu = FakeDevices()
    pool = PinnedPool(gpu, limit=2 * MIN_BLOCK)
    held = [pool.lend(100) for _ in range(3)]
    assert [block is not None for _, block in held] == [True, True, False]
    assert pool.pooled == 2 * MIN_BLOCK
    assert (pool.made, pool.fresh, pool.lent) == (2, 1, 2)
    assert all(flat.numel() == 100 for flat, _ in held)
    del held
    assert pool.lent == 0
    assert pool.free_bytes() == 2 * MIN_BLOCK


def test_PinnedPool_drops_free_blocks_of_other_sizes_to_make_room() -> None:
    gpu = FakeDevices()
    pool = PinnedPool(gpu, limit=4 * MIN_BLOCK)
    small = [pool.lend(MIN_BLOCK) for _ in range(3)]
    del small
    flat, block = pool.lend(4 * MIN_BLOCK)
    assert block is not None
    assert (pool.dropped, pool.pooled, pool.free_bytes()) == (3, 4 * MIN_BLOCK, 0)
    assert flat.numel() == 4 * MIN_BLOCK


def test_PinnedPool_block_comes_back_only_when_every_view_is_freed() -> None:
    pool = PinnedPool(FakeDevices())
    flat, _ = pool.lend(64)
    view = flat.view(torch.int32)[4:]
    del flat
    assert pool.lent == 1
    del view
    assert pool.lent == 0


def test_PinnedPool_1000_staged_transfers_use_one_block() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=4096)
    pool = transfer.pinned
    tensor = source(10_000)
    for _ in range(1000):
        policy = transfer.policy(MAP)
        _, host = policy.to_host(tensor)
        gpu.run(gpu.default_stream(0))
        gpu.run(transfer.out_stream(0))
        assert host_bytes(host)[-5:] == tensor.value[-5:]
        del host, policy
    assert (pool.made, pool.reused, pool.fresh, pool.lent) == (1, 999, 0, 0)
    assert pool.pooled == MIN_BLOCK
    assert gpu.host_buffers == 1
    assert transfer.chunked == 3000
    stats = transfer.stats()
    assert stats["cuda_pinned_made"] == 1
    assert stats["cuda_staged_chunks"] == 3000


# -- a frame in parts --------------------------------------------------------------------


def frame_of(host: FakeTensor) -> list[Any]:
    """A frame as the wire lays it out: prelude and header bytes, then the segment (a
    read-only view of the staged host bytes), then a CPU segment."""
    segment = memory_view(host.host.data_ptr(), host.host.numel(), writable=False)
    return [b"prelude+header", segment, b"cpu tensor"]


def test_address_of_reads_read_only_views() -> None:
    flat = torch.zeros(16, dtype=torch.uint8)
    view = memory_view(flat.data_ptr() + 4, 8, writable=False)
    assert address_of(view) == flat.data_ptr() + 4
    assert address_of(memoryview(b"")) >= 0


def test_split_frame_cuts_pieces_at_chunk_boundaries() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    _, host = policy.to_host(source(20))
    parts = transfer.parts(policy, frame_of(host))
    events = [event for _, _, event in policy.chunks]
    assert [waits for _, waits in parts] == [(events[0],), (events[1],), (events[2],)]
    sizes = [[len(bytes(p)) for p in pieces] for pieces, _ in parts]
    assert sizes == [[14, 8], [8], [4, 10]]  # the header rides with chunk 1, the rest last
    # Nothing staged in chunks: the frame whole, waiting for nothing.
    assert transfer.parts(transfer.policy(MAP), [b"a", b"b"]) == [([b"a", b"b"], ())]


@pytest.mark.asyncio
async def test_frame_parts_write_nothing_before_the_first_chunk_and_no_chunk_early() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    gpu.launch(gpu.default_stream(0), "writes the tensor")
    policy = transfer.policy(MAP)
    tensor = source(20)
    _, host = policy.to_host(tensor)
    frame = frame_of(host)
    parts = transfer.parts(policy, frame)
    written: list[bytes] = []  # what a socket would have read, at the time it read it

    async def write() -> None:
        async for pieces in frame_parts(gpu, parts, first_poll=1e-4, max_poll=1e-3):
            written.append(b"".join(bytes(p) for p in pieces))

    writer = asyncio.ensure_future(write())
    out = transfer.out_stream(0)
    await asyncio.sleep(0.01)
    assert written == []  # the producer still runs: not even the header went
    gpu.run(gpu.default_stream(0))
    gpu.run(out, 2)  # the wait and chunk 1
    for _ in range(100):  # bounded: the writer polls every 1 ms at most
        if written:
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert written == [b"prelude+header" + tensor.value[:8]]  # chunk 1's bytes, as copied
    gpu.run(out)
    await asyncio.wait_for(writer, 2)
    assert b"".join(written) == b"prelude+header" + tensor.value + b"cpu tensor"
    assert len(written) == 3


@pytest.mark.asyncio
async def test_frame_parts_of_two_tensors_on_two_devices_keep_the_frame_order() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    a, b = source(12, seed=3), FakeTensor(1, source(12, seed=5).value, nbytes=12)
    _, host_a = policy.to_host(a)
    _, host_b = policy.to_host(b)
    frame = [b"h", *frame_of(host_a)[1:2], b"-", *frame_of(host_b)[1:2]]
    parts = transfer.parts(policy, frame)
    assert len(parts) == 4
    gpu.run(transfer.out_stream(1))  # device 1's copies finish first: they still wait
    written: list[bytes] = []

    async def write() -> None:
        async for pieces in frame_parts(gpu, parts, first_poll=1e-4, max_poll=1e-3):
            written.append(b"".join(bytes(p) for p in pieces))

    writer = asyncio.ensure_future(write())
    await asyncio.sleep(0.01)
    assert written == []
    gpu.run(transfer.out_stream(0))
    await asyncio.wait_for(writer, 2)
    assert b"".join(written) == b"h" + a.value + b"-" + b.value


@pytest.mark.asyncio
async def test_StagedTransfer_ready_gives_a_frame_of_several_chunks_in_parts() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    tensor = source(20)
    _, host = policy.to_host(tensor)
    ready = transfer.ready(policy)
    assert isinstance(ready, FrameInParts)  # what the links write part by part
    written: list[bytes] = []

    async def write() -> None:
        async for pieces in ready.parts(frame_of(host)):
            written.append(b"".join(bytes(p) for p in pieces))

    writer = asyncio.ensure_future(write())
    out = transfer.out_stream(0)
    gpu.run(out, 2)  # the wait on the producer, and chunk 1
    await until_async(lambda: bool(written), 2.0)
    assert written == [b"prelude+header" + tensor.value[:8]]  # chunks 2 and 3 still copying
    gpu.run(out)
    await asyncio.wait_for(writer, 2)
    assert b"".join(written) == b"prelude+header" + tensor.value + b"cpu tensor"


@pytest.mark.asyncio
async def test_StagedParts_started_returns_once_the_first_chunk_is_on_the_host() -> None:
    # What the outbox holds a request aside for: past it, the rest of the frame follows as
    # fast as its copies run, so the links may take the connection for it.
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    policy = transfer.policy(MAP)
    producer = gpu.launch(gpu.default_stream(0), "writes the tensor")
    policy.to_host(source(20))
    ready = transfer.ready(policy)
    assert isinstance(ready, StagedParts)
    started = asyncio.ensure_future(ready.started())
    await asyncio.sleep(0.01)
    out = transfer.out_stream(0)
    assert gpu.run(out) == 0  # waits for the producer's kernel
    assert not started.done()
    gpu.run(gpu.default_stream(0))
    assert producer.done
    gpu.run(out, 2)  # the wait, and chunk 1: chunks 2 and 3 still copying
    await asyncio.wait_for(started, 2)


def test_StagedTransfer_ready_waits_whole_for_one_chunk_or_a_strided_copy() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu, chunk_bytes=8)
    one_chunk = transfer.policy(MAP)
    one_chunk.to_host(source(8))
    strided = transfer.policy(MAP)
    strided.to_host(source(20))
    strided.to_host(FakeTensor(0, "strided"))  # its bytes are in no chunk
    for policy in (one_chunk, strided):
        ready = transfer.ready(policy)
        assert ready is not None
        assert not isinstance(ready, FrameInParts)  # asked, never awaited: nothing left
