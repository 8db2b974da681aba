"""Device maps as a call-pipeline hook (layer L2): which of the callee's devices a CUDA
tensor lands on, for requests and for their replies.

torch's rule: a caller's map (its device -> the callee's) applies to the request, and the
same map read backwards to the reply. The caller knows both, so its request carries the
backward map in a header field (``dm``) and the callee applies it to the reply; the callee
needs no copy of its callers' options. Without a map the serializer's default refuses a
CUDA tensor with an error that says what to do.

How the bytes cross (``transfer``) is a ``TensorPolicy`` made from a map: the host copy
below, or the CUDA path's staged copies (``staging.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.runtime.calls.pipeline import CallHook, IncomingCall, OutgoingCall

__all__ = ["FIELD", "DeviceMapHook", "HostCopy", "Transfer"]

FIELD = "dm"  # the header field this hook owns: the reply's map, "cuda:i" -> "cuda:j"

# Makes the policy that moves one message's CUDA tensors under a device map.
Transfer = Callable[[Mapping[str, str]], TensorPolicy]


class HostCopy(TensorPolicy):
    """Maps devices and copies through host memory, waiting for the device on the spot.

    The simplest correct transfer: ``to_host`` synchronizes the tensor's current stream
    (so the kernels that wrote it are done) and copies it to pageable memory; the receiver
    copies the segment to its device with a blocking copy. The staged transfer does the
    same work without blocking any thread.
    """

    __slots__ = ("device_map",)

    def __init__(self, device_map: Mapping[str, str]) -> None:
        self.device_map = device_map

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        target = self.device_map.get(str(tensor.device))
        if target is None:
            return super().to_host(tensor)  # raises: the map does not name this device
        torch.cuda.current_stream(tensor.device).synchronize()
        return target, tensor.detach().cpu()


class DeviceMapHook(CallHook):
    """Gives each call to a mapped callee, and each reply to a mapped caller, its map."""

    def __init__(
        self, device_maps: Mapping[str, Mapping[str, str]] | None, transfer: Transfer = HostCopy
    ) -> None:
        self._maps = {callee: dict(m) for callee, m in (device_maps or {}).items() if m}
        self._backward = {callee: _inverse(m) for callee, m in self._maps.items()}
        self._transfer = transfer

    def __repr__(self) -> str:
        return f"DeviceMapHook({sorted(self._maps)})"

    def active(self) -> bool:
        return bool(self._maps)

    def prepare(self, call: OutgoingCall) -> None:
        forward = self._maps.get(call.callee)
        if forward is None:
            return
        call.policy.devices = self._transfer(forward)
        backward = self._backward[call.callee]
        call.reply_policy.devices = self._transfer(backward)
        call.headers[FIELD] = backward

    def receiving(self, call: IncomingCall) -> None:
        backward = call.headers.get(FIELD)
        if backward is None:
            return
        call.reply_policy.devices = self._transfer(_checked(backward, call.caller))

    def debug_info(self) -> dict[str, Any]:
        return {"device_maps": {callee: dict(m) for callee, m in self._maps.items()}}


def _inverse(device_map: Mapping[str, str]) -> dict[str, str]:
    return {v: k for k, v in device_map.items()}


def _checked(value: object, caller: str) -> dict[str, str]:
    """The reply map a caller sent, checked: strings naming CUDA devices both ways."""
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) and k.startswith("cuda") and v.startswith("cuda")
        for k, v in value.items()
    ):
        return value
    raise SerializationError(f"worker {caller!r} sent a malformed device map: {value!r}")
