"""``forward`` and ``forward_async``, installed on every ``RemoteModule`` instance (L4).

They are plain module-level functions bound to each instance, as torch installs its
generated methods: they travel by reference when a ``RemoteModule`` is sent to another
worker, and the receiver binds them again.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from asyncrpc.api import rpc_async, rpc_sync
from asyncrpc.nn.owner import run_forward
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.futures import Future

__all__ = ["GENERATED_METHODS", "forward", "forward_async"]


class _Remote(Protocol):
    """What the methods read from the ``RemoteModule`` they are bound to."""

    module_rref: RRef[nn.Module]
    device: str
    is_device_map_set: bool


def forward_async(self: _Remote, *args: Any, **kwargs: Any) -> Future[Any]:
    """Start the remote module's ``forward(*args, **kwargs)`` on its owner.

    Returns:
        An ``asyncrpc.Future`` of the result: ``.wait()`` blocks, ``await`` suspends (it is
        awaitable from any event loop), ``.then`` chains. Under a distributed autograd
        context the call is recorded, so ``asyncrpc.autograd.backward`` reaches the owner.
        Cancelling the future cancels the remote call.

    Raises:
        The errors of ``rpc_async`` at once; the module's own errors, with their original
        type, through the future.
    """
    owner = self.module_rref.owner_name()
    call_args = (self.module_rref, self.device, self.is_device_map_set, *args)
    return rpc_async(owner, run_forward, call_args, kwargs)


def forward(self: _Remote, *args: Any, **kwargs: Any) -> Any:
    """Run the remote module's ``forward(*args, **kwargs)`` on its owner and wait for it.

    Returns:
        The result, copied here.

    Raises:
        BlockingCallError: called on the agent's event loop (``await forward_async`` there).
        The module's own errors, with their original type, and the errors of ``rpc_sync``.
    """
    owner = self.module_rref.owner_name()
    call_args = (self.module_rref, self.device, self.is_device_map_set, *args)
    return rpc_sync(owner, run_forward, call_args, kwargs)


GENERATED_METHODS = (forward_async, forward)
"""Installed on each instance under their own names, in this order."""
