"""``RemoteModule``: an ``nn.Module`` whose module lives on another worker (layer L4).

This package only re-exports; ``asyncrpc.nn.RemoteModule`` stands in for
``torch.distributed.nn.RemoteModule``.
"""

from __future__ import annotations

from asyncrpc.nn.errors import ScriptRemoteModuleError, UnsupportedMethodError
from asyncrpc.nn.module import REMOTE_MODULE_PICKLED_ATTRIBUTES, RemoteModule

__all__ = [
    "REMOTE_MODULE_PICKLED_ATTRIBUTES",
    "RemoteModule",
    "ScriptRemoteModuleError",
    "UnsupportedMethodError",
]
