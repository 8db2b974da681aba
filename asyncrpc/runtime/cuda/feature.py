"""CUDA as a feature of the agent: device maps on every call, and the transfer that moves
CUDA tensors (layer L2.45).

Without CUDA set up (no GPU, or ``cuda_transfer="host"``) the transfer is a
``HostTransfer``: tensors cross through host memory, copied on the spot; that null
object is the only "no GPU" case, so nothing above asks whether there is one. With a GPU
it is a ``StagedTransfer``: copies on side streams through pinned memory, held by the
send gate, and CUDA IPC to peers on this host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrpc.errors import PeerLostError
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.wire import Allocator
from asyncrpc.runtime.calls.pipeline import CallHook
from asyncrpc.runtime.cuda.maps import DeviceMapHook, HostTransfer, Transfer
from asyncrpc.runtime.cuda.staging import cuda_transfer
from asyncrpc.runtime.feature import Feature

__all__ = ["CudaFeature"]


class CudaFeature(Feature):
    """Device maps and CUDA transfers of one worker.

    Args:
        options: the worker's options (``device_maps``, ``cuda_transfer``...).
        same_host: whether a rank runs on this host (CUDA IPC may reach it).
    """

    name = "cuda"

    def __init__(self, options: RpcBackendOptions, same_host: Callable[[int], bool]) -> None:
        staged = cuda_transfer(options, same_host)
        self.transfer: Transfer = HostTransfer() if staged is None else staged
        self.device_maps = {callee: dict(m) for callee, m in (options.device_maps or {}).items()}
        self.hook = DeviceMapHook(options.device_maps, self.transfer)

    def hooks(self) -> Sequence[CallHook]:
        # Device maps ride on every agent: a callee applies its callers' reply maps.
        return (self.hook,)

    def allocator(self, plain: Allocator) -> Allocator:
        """The wire's allocator of receive memory (pinned for CUDA segments, with a GPU)."""
        return self.transfer.allocator(plain)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        self.transfer.on_peer_lost(rank)  # CUDA IPC memory it held is dropped for it
