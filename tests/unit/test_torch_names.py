"""The public names of torch.distributed.rpc that a program's set-up lines touch exist on
asyncrpc with torch's signatures and defaults, so ``import asyncrpc as rpc`` runs them."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.rpc as torch_rpc

import asyncrpc
from asyncrpc.api import _check_name
from asyncrpc.errors import InitArgumentError
from asyncrpc.protocol.options import coerce_options

# Names a program written for torch.distributed.rpc calls or builds (the rest of torch's
# module namespace is its implementation: agents, stores, submodules).
USED_BY_PROGRAMS = (
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef", "PyRRef",
    "WorkerInfo", "get_worker_info", "get_rpc_timeout", "functions", "RpcBackendOptions",
    "TensorPipeRpcBackendOptions", "BackendType", "is_available",
)  # fmt: skip


@pytest.mark.parametrize("name", USED_BY_PROGRAMS)
def test_torch_name_exists_on_asyncrpc(name: str) -> None:
    assert hasattr(torch_rpc, name)  # the list names torch's real names
    assert hasattr(asyncrpc, name)


def test_TensorPipeRpcBackendOptions_has_torchs_defaults() -> None:
    ours = asyncrpc.TensorPipeRpcBackendOptions()
    theirs = torch_rpc.TensorPipeRpcBackendOptions()
    assert ours.num_worker_threads == theirs.num_worker_threads
    assert ours.rpc_timeout == theirs.rpc_timeout
    assert ours.init_method == theirs.init_method
    assert ours.device_maps is None
    assert ours.devices is None


def test_TensorPipeRpcBackendOptions_takes_torchs_keywords_only() -> None:
    ours = inspect.signature(asyncrpc.TensorPipeRpcBackendOptions.__init__).parameters
    for name in ("num_worker_threads", "rpc_timeout", "init_method", "device_maps",
                 "devices", "_transports", "_channels"):  # fmt: skip
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    with pytest.raises(TypeError):
        asyncrpc.TensorPipeRpcBackendOptions(8)  # type: ignore[misc]


def test_TensorPipeRpcBackendOptions_is_asyncrpcs_options() -> None:
    options = asyncrpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, rpc_timeout=5, init_method="tcp://127.0.0.1:1",
        device_maps={"w1": {0: 1}}, _transports=["uv"], _channels=["basic"],
        shared_memory=False,
    )  # fmt: skip
    options.set_device_map("w2", {1: 0})
    assert isinstance(options, asyncrpc.RpcBackendOptions)
    assert coerce_options(options) is options
    assert options.num_worker_threads == 4
    assert options.rpc_timeout == 5
    assert options.shared_memory is False
    assert options.device_maps == {"w1": {"cuda:0": "cuda:1"}, "w2": {"cuda:1": "cuda:0"}}


def test_TensorPipeRpcBackendOptions_refuses_unknown_keywords() -> None:
    with pytest.raises(TypeError):
        asyncrpc.TensorPipeRpcBackendOptions(no_such_option=1)  # type: ignore[call-arg]


def test_BackendType_TENSORPIPE_is_accepted_and_others_refused() -> None:
    _check_name("w0", asyncrpc.BackendType.TENSORPIPE)
    _check_name("w0", torch_rpc.BackendType.TENSORPIPE)
    with pytest.raises(InitArgumentError):
        _check_name("w0", "TENSORPIPE")


def test_is_available_and_PyRRef() -> None:
    assert asyncrpc.is_available() is True
    assert asyncrpc.PyRRef is asyncrpc.RRef
