"""The functions a ``RemoteModule`` runs on the worker that owns its module (layer L4).

They travel by reference in RPCs, so they live at module level; each works on the local
value behind the module's ``RRef``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncrpc.rref.handle import RRef

__all__ = ["create_module", "move_tensors", "parameter_rrefs", "run_forward", "set_training"]


def create_module(
    module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> nn.Module:
    """Build ``module_cls(*args, **kwargs)`` and place it on ``device`` (the ``remote`` body).

    Raises:
        ValueError: the constructor returned something that is not an ``nn.Module``.
        Whatever the constructor raises, as it is.
    """
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        # torch's wording: users and torch's tests match it.
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    return module.to(device)


def move_tensors(value: Any, device: torch.device) -> Any:
    """Return ``value`` with every tensor in nested tuples, lists and dicts on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        moved = [move_tensors(item, device) for item in value]
        if hasattr(value, "_fields"):  # a namedtuple takes its fields positionally
            return type(value)(*moved)
        return type(value)(moved)
    if isinstance(value, dict):
        return {key: move_tensors(item, device) for key, item in value.items()}
    return value


def run_forward(
    module_rref: RRef[nn.Module], device: str, is_device_map_set: bool, *args: Any, **kwargs: Any
) -> Any:
    """Call the owned module's ``forward`` with the caller's arguments.

    A module on a CUDA device gets its tensor arguments moved there first; without a
    device map for the way back, CUDA results come back as CPU tensors (the wire could not
    carry them otherwise), as torch's RemoteModule does.
    """
    module = module_rref.local_value()
    placed = torch.device(device)
    if placed.type != "cuda":
        return module.forward(*args, **kwargs)
    result = module.forward(*move_tensors(args, placed), **move_tensors(kwargs, placed))
    return result if is_device_map_set else move_tensors(result, torch.device("cpu"))


def parameter_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    """Owner RRefs to the owned module's parameters (forked to the caller on return)."""
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def set_training(module_rref: RRef[nn.Module], mode: bool) -> None:
    """Switch the owned module (and its children) to training or evaluation mode."""
    module_rref.local_value().train(mode)
