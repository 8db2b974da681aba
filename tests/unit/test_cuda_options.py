"""The callee stream pool's options: checked at init, typed, and sizing the pool."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.errors import InitError
from asyncrpc.protocol.options import RpcBackendOptions, TensorPipeRpcBackendOptions
from asyncrpc.runtime.cuda.callee import POOL_STREAMS, POOL_TIMEOUT_S, CalleeStreams
from asyncrpc.runtime.cuda.fake import FakeDevices
from asyncrpc.runtime.cuda.pinned import PINNED_POOL_BYTES
from asyncrpc.runtime.cuda.staging import StagedTransfer


def test_RpcBackendOptions_stream_pool_defaults_are_the_pools() -> None:
    options = RpcBackendOptions()
    assert options.cuda_stream_pool_size == POOL_STREAMS == 32
    assert options.cuda_stream_pool_timeout == POOL_TIMEOUT_S == 30.0


@pytest.mark.parametrize("size", [0, -1, 2.5, "8", True, None])
def test_RpcBackendOptions_bad_stream_pool_size_is_an_init_error(size: Any) -> None:
    with pytest.raises(InitError) as caught:
        RpcBackendOptions(cuda_stream_pool_size=size)
    assert "cuda_stream_pool_size" in str(caught.value)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "30", True, None])
def test_RpcBackendOptions_bad_stream_pool_timeout_is_an_init_error(timeout: Any) -> None:
    with pytest.raises(InitError) as caught:
        RpcBackendOptions(cuda_stream_pool_timeout=timeout)
    assert "cuda_stream_pool_timeout" in str(caught.value)


def test_TensorPipeRpcBackendOptions_takes_the_stream_pool_options_by_keyword() -> None:
    options = TensorPipeRpcBackendOptions(cuda_stream_pool_size=4, cuda_stream_pool_timeout=2)
    assert (options.cuda_stream_pool_size, options.cuda_stream_pool_timeout) == (4, 2)


def test_CalleeStreams_from_options_sizes_the_pool() -> None:
    options = RpcBackendOptions(cuda_stream_pool_size=3, cuda_stream_pool_timeout=0.5)
    gpu = FakeDevices()
    callee = CalleeStreams.from_options(gpu, options)
    assert (callee.pool.per_device, callee.pool.timeout) == (3, 0.5)
    leases = [callee.pool.try_acquire([0]) for _ in range(4)]
    assert [lease is not None for lease in leases] == [True, True, True, False]
    assert gpu.streams_made == 3


def test_RpcBackendOptions_pinned_pool_bytes_default_and_bad_values() -> None:
    assert RpcBackendOptions().cuda_pinned_pool_bytes == PINNED_POOL_BYTES == 512 << 20
    assert RpcBackendOptions(cuda_pinned_pool_bytes=0).cuda_pinned_pool_bytes == 0
    for bad in (-1, 1.5, "1", None, True):
        with pytest.raises(InitError) as caught:
            RpcBackendOptions(cuda_pinned_pool_bytes=bad)  # type: ignore[arg-type]
        assert "cuda_pinned_pool_bytes" in str(caught.value)


def test_StagedTransfer_from_options_sizes_both_pools() -> None:
    options = RpcBackendOptions(
        cuda_stream_pool_size=2, cuda_stream_pool_timeout=1.5, cuda_pinned_pool_bytes=1 << 20
    )
    transfer = StagedTransfer.from_options(FakeDevices(), options)
    assert transfer.callee is not None
    assert (transfer.callee.pool.per_device, transfer.callee.pool.timeout) == (2, 1.5)
    assert transfer.pinned.limit == 1 << 20
    held = [transfer.pinned.lend(1 << 19) for _ in range(3)]  # two 512 KiB blocks fit
    assert [block is not None for _, block in held] == [True, True, False]


@pytest.mark.parametrize("mode", ["staged", "auto", "ipc"])
def test_cuda_transfer_builds_the_transfer_the_options_ask_for(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from asyncrpc.runtime.cuda import real
    from asyncrpc.runtime.cuda.staging import cuda_transfer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(real, "CudaDevices", FakeDevices)  # the seam, without a GPU
    options = RpcBackendOptions(
        cuda_transfer=mode, cuda_stream_pool_size=5, cuda_pinned_pool_bytes=1 << 20
    )
    transfer = cuda_transfer(options, lambda rank: True)
    assert transfer is not None
    assert isinstance(transfer.devices, FakeDevices)
    assert transfer.callee is not None
    assert transfer.callee.pool.per_device == 5
    assert transfer.pinned.limit == 1 << 20
    assert (transfer.ipc is not None) == (mode != "staged")
