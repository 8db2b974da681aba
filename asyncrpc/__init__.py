"""asyncrpc: an asyncio-native RPC framework for PyTorch, a drop-in for torch.distributed.rpc.

This module only re-exports the public API.
"""

from __future__ import annotations

from asyncrpc import functions
from asyncrpc.api import (
    call,
    get_debug_info,
    get_metrics,
    get_rpc_timeout,
    get_worker_info,
    get_worker_infos,
    init_rpc,
    init_rpc_async,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
    shutdown_async,
    worker,
)
from asyncrpc.errors import (
    AsyncRpcError,
    BlockingCallError,
    ClosedError,
    ConnectionLostError,
    FrameTooLargeError,
    FunctionNotFoundError,
    InitError,
    NotInitializedError,
    PeerLostError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
    RemoteProtocolError,
    RpcTimeoutError,
    RRefError,
    RRefOwnerLostError,
    RRefTimeoutError,
    SerializationError,
    ShutdownError,
    ThreadPoolExhaustedError,
    UnknownWorkerError,
)
from asyncrpc.protocol.serde import register_reducer
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.future import Future, collect_all, wait_all
from asyncrpc.runtime.options import RpcBackendOptions, WorkerInfo

__all__ = [
    "AsyncRpcError",
    "BlockingCallError",
    "ClosedError",
    "ConnectionLostError",
    "FrameTooLargeError",
    "FunctionNotFoundError",
    "Future",
    "InitError",
    "NotInitializedError",
    "PeerLostError",
    "PeerUnavailableError",
    "ProtocolError",
    "RRef",
    "RRefError",
    "RRefOwnerLostError",
    "RRefTimeoutError",
    "RemoteError",
    "RemoteProtocolError",
    "RpcBackendOptions",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "ThreadPoolExhaustedError",
    "UnknownWorkerError",
    "WorkerInfo",
    "call",
    "collect_all",
    "functions",
    "get_debug_info",
    "get_metrics",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "init_rpc_async",
    "register_reducer",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "shutdown_async",
    "wait_all",
    "worker",
]
