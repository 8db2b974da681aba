"""Unit tests: TorchScript refuses asyncrpc's RPC API with ``TorchScriptCallError``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch
    from torch import Tensor

    import asyncrpc as rpc  # a torch program ported by its imports
    from asyncrpc.errors import TorchScriptCallError


@pytest.fixture(autouse=True)
def _scripting_is_deprecated() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script, in torch 2.13
        yield


def _script_add(x: Tensor, y: Tensor) -> Tensor:
    return x + y


def test_TorchScriptCallError_for_torchs_documented_async_execution_example() -> None:
    script_add = torch.jit.script(_script_add)
    with pytest.raises(TorchScriptCallError) as info:

        @rpc.functions.async_execution
        @torch.jit.script
        def async_add(to: str, x: Tensor, y: Tensor) -> Any:
            return rpc.rpc_async(to, script_add, (x, y))

    assert info.value.function == "asyncrpc.rpc_async"
    assert isinstance(info.value, RuntimeError)  # NotImplementedError is one
    assert "asyncrpc does not support calling RPC from TorchScript" in str(info.value)
    assert "torch.distributed.rpc" in str(info.value)


def _calls_rpc_sync(to: str, x: Tensor) -> Tensor:
    return rpc.rpc_sync(to, torch.add, (x, x))  # type: ignore[no-any-return]


def _calls_remote(to: str, x: Tensor) -> int:
    rpc.remote(to, torch.add, (x, x))
    return 0


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (_calls_rpc_sync, "asyncrpc.rpc_sync"),
        (_calls_remote, "asyncrpc.remote"),
        (rpc.rpc_async, "asyncrpc.rpc_async"),  # scripted itself
    ],
    ids=["rpc_sync", "remote", "rpc_async_itself"],
)
def test_TorchScriptCallError_names_the_function(fn: Callable[..., Any], name: str) -> None:
    with pytest.raises(TorchScriptCallError) as info:
        torch.jit.script(fn)
    assert info.value.function == name


def test_TorchScriptCallError_leaves_scripting_of_other_functions_alone() -> None:
    scripted = torch.jit.script(_script_add)
    assert scripted(torch.ones(1), torch.ones(1)).item() == 2.0
