"""The callee stream pool's options: checked at init, typed, and sizing the pool."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc.errors import InitError
from asyncrpc.protocol.options import RpcBackendOptions, TensorPipeRpcBackendOptions
from asyncrpc.runtime.cuda.callee import POOL_STREAMS, POOL_TIMEOUT_S, CalleeStreams
from asyncrpc.runtime.cuda.fake import FakeDevices


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
