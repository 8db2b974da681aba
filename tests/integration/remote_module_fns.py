"""Modules and functions the RemoteModule integration tests use (importable on every worker)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc.nn import RemoteModule


class Affine(nn.Module):
    """A small linear layer whose weights depend only on ``seed`` (same on every worker)."""

    def __init__(self, seed: int, width: int = 3) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(width, width, generator=generator))
        self.bias = nn.Parameter(torch.randn(width, generator=generator))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return (x @ self.weight + self.bias) * scale


class WhereAmI(nn.Module):
    """Answers with the worker that runs ``forward`` and its arguments."""

    def __init__(self, tag: str, *, suffix: str = "") -> None:
        super().__init__()
        self.tag = tag + suffix

    def forward(self, x: torch.Tensor, word: str = "default") -> tuple[str, str, str, Any]:
        return asyncrpc.get_worker_info().name, self.tag, word, x * 2


class FailingModule(nn.Module):
    """A module whose constructor raises the user's own ``KeyError``."""

    def __init__(self, key: str) -> None:
        super().__init__()
        raise KeyError(key)


class NotAModule:
    """What a faulty ``module_cls`` returns: not an ``nn.Module``."""

    def __init__(self, value: int) -> None:
        self.value = value


def forward_on_me(remote_module: RemoteModule, x: torch.Tensor) -> tuple[str, Any]:
    """Run a received RemoteModule's ``forward`` here; returns this worker's name too."""
    return asyncrpc.get_worker_info().name, remote_module.forward(x)


def forward_async_on_me(remote_module: RemoteModule, x: torch.Tensor) -> Any:
    """Run a received RemoteModule's ``forward_async`` here and wait for it."""
    return remote_module.forward_async(x).wait()


def attributes(remote_module: RemoteModule) -> list[str]:
    """The attribute names a received RemoteModule has."""
    return list(remote_module.__dict__)


def training_flag(module_rref: asyncrpc.RRef[nn.Module]) -> bool:
    """The owned module's ``training`` flag (run on the owner)."""
    return module_rref.local_value().training


def wrap_module_rref(remote_device: str, module_rref: asyncrpc.RRef[nn.Module]) -> RemoteModule:
    """Build a RemoteModule here over a received module RRef."""
    return RemoteModule.init_from_module_rref(remote_device, module_rref)
