"""A tensor staged into the pinned pool crosses the real serializer and frame codec: its
segment is a view of the lent block, the serializer's keepalive holds the block lent until
it is dropped, and the frame cut into parts at chunk boundaries is the same bytes. No
GPU: one marked tensor says it is not in CPU memory and stands for a CUDA tensor; the
host view is ``CudaDevices.host_view`` itself."""

from __future__ import annotations

import torch

from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Reply
from asyncrpc.runtime.cuda.fake import FakeDevices
from asyncrpc.runtime.cuda.parts import address_of, split_frame
from asyncrpc.runtime.cuda.pinned import MIN_BLOCK, PinnedPool
from asyncrpc.runtime.cuda.real import CudaDevices

CHUNK = 4096


class Staged(TensorPolicy):
    """``StagedCopy``'s chunked path with the copies done at once on the CPU."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self.chunks: list[tuple[int, int, object]] = []

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        nbytes = tensor.numel() * tensor.element_size()
        flat, _ = self.pool.lend(nbytes)
        source = tensor.reshape(-1).view(torch.uint8)  # what CudaDevices.copy_out reads
        address = flat.data_ptr()
        for start in range(0, nbytes, CHUNK):
            stop = min(start + CHUNK, nbytes)
            flat[start:stop].copy_(source[start:stop])
            self.chunks.append((address + start, address + stop, f"chunk {start}"))
        real = object.__new__(CudaDevices)  # host_view needs no GPU
        return "cuda:0", real.host_view(flat, tensor)


class Land(TensorPolicy):
    def to_device(self, segment: torch.Tensor, device: str) -> torch.Tensor:
        return segment  # the bytes as they arrived (a GPU's copy-in is not under test)


def test_a_pooled_staged_tensor_crosses_the_wire_and_its_block_comes_back(
    on_device: set[int],
) -> None:
    pool = PinnedPool(FakeDevices())
    sent = torch.arange(5000, dtype=torch.float32).reshape(50, 100)  # 20,000 bytes
    on_device.add(id(sent))
    policy = Staged(pool)
    payload, segments, keep, _ = Serializer().dumps({"x": sent}, policy=policy)
    ((view, tag),) = segments
    assert tag == "cuda:0"
    assert address_of(view) == policy.chunks[0][0]  # the segment is the lent block
    pieces = encode_frame(Reply(1).to_fields(), payload, segments)
    whole = b"".join(bytes(p) for p in pieces)
    parts = split_frame(pieces, policy.chunks)
    assert [waits for _, waits in parts] == [(f"chunk {s}",) for s in range(0, 20000, CHUNK)]
    assert b"".join(bytes(p) for part, _ in parts for p in part) == whole
    (frame,) = FrameDecoder().feed(whole)
    received = Serializer().loads(frame.payload, frame.segments, policy=Land())["x"]
    assert torch.equal(received, sent)
    del payload, segments, view, pieces, parts
    assert pool.lent == 1  # the keepalive holds the host tensor, and so the block
    del keep
    assert pool.lent == 0
    assert pool.free_bytes() == pool.pooled == MIN_BLOCK


def test_CudaDevices_copies_only_plain_contiguous_tensors_in_ranges() -> None:
    real = object.__new__(CudaDevices)  # contiguous_nbytes needs no GPU
    x = torch.randn(4, 6, dtype=torch.complex64)
    assert real.contiguous_nbytes(x) == 4 * 6 * 8
    assert real.contiguous_nbytes(x.t()) is None  # strided: copied whole, strides kept
    assert real.contiguous_nbytes(x.conj()) is None  # the bit is not in the bytes
    assert real.contiguous_nbytes(torch.randn(3)._neg_view()) is None


def test_PinnedPool_takes_blocks_back_from_other_threads() -> None:
    import threading

    pool = PinnedPool(FakeDevices())
    held = [pool.lend(1000)[0] for _ in range(8)]
    assert pool.lent == 8

    def drop() -> None:
        held.clear()  # the last references go on this thread

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
    assert (pool.lent, pool.free_bytes()) == (0, 8 * MIN_BLOCK)
    assert pool.lend(1000)[1] is not None
    assert pool.reused == 1
