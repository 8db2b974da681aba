"""Unit tests of asyncrpc.protocol.serde.buffers.ReceiveBuffers: pooled large receive buffers."""

from __future__ import annotations

import gc
import warnings

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch

    from asyncrpc.protocol.serde.buffers import LARGE_BUFFER_BYTES, ReceiveBuffers

LARGE = LARGE_BUFFER_BYTES


def test_ReceiveBuffers_small_buffers_are_plain_torch_tensors() -> None:
    buffers = ReceiveBuffers()
    small = buffers.allocate(1000)
    assert small.dtype == torch.uint8
    assert small.numel() == 1000
    small.resize_(5000)  # torch's own allocator: resizable like any tensor
    assert buffers.pooled_bytes == 0


def test_ReceiveBuffers_reuses_a_buffer_only_after_its_tensors_are_gone() -> None:
    buffers = ReceiveBuffers(capacity=4 * LARGE)
    first = buffers.allocate(LARGE)
    address = first.data_ptr()
    view = first[100:200]
    del first
    second = buffers.allocate(LARGE)
    assert second.data_ptr() != address  # the view still holds the first buffer
    del view
    gc.collect()
    third = buffers.allocate(LARGE)
    assert third.data_ptr() == address
    assert third.numel() == LARGE
    assert buffers.pooled_bytes == 2 * LARGE


def test_ReceiveBuffers_sizes_round_up_to_whole_huge_pages() -> None:
    buffers = ReceiveBuffers(capacity=4 * LARGE)
    odd = buffers.allocate(LARGE + 1)
    assert odd.numel() == LARGE + 1
    odd[-1] = 7  # the last byte is addressable
    address = odd.data_ptr()
    del odd
    again = buffers.allocate(LARGE + 1000)  # same 2 MiB size class
    assert again.data_ptr() == address


def test_ReceiveBuffers_never_pools_more_than_its_capacity() -> None:
    buffers = ReceiveBuffers(capacity=2 * LARGE)
    held = [buffers.allocate(LARGE) for _ in range(3)]
    assert buffers.pooled_bytes == 2 * LARGE  # the third is not kept
    del held[0]
    gc.collect()
    bigger = buffers.allocate(2 * LARGE)  # evicts the unused one, cannot fit beside held[0]
    assert bigger.numel() == 2 * LARGE
    assert buffers.pooled_bytes <= 2 * LARGE


def test_ReceiveBuffers_zero_capacity_keeps_nothing() -> None:
    buffers = ReceiveBuffers(capacity=0)
    tensor = buffers.allocate(LARGE)
    tensor.fill_(1)
    assert int(tensor[-1]) == 1
    assert buffers.pooled_bytes == 0
