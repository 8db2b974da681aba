"""Serialization for asyncrpc: pickle with out-of-band tensors and remote exceptions (L1).

Re-exports only; see ``pickler`` (``Serializer``), ``tensors`` (segment layout),
``reducers`` (custom reductions) and ``exceptions`` (remote errors keep their type).
"""

from __future__ import annotations

from asyncrpc.protocol.serde.exceptions import pack_exception, unpack_exception
from asyncrpc.protocol.serde.pickler import (
    Discard,
    Dumped,
    PersistentDump,
    PersistentLoad,
    Serializer,
)
from asyncrpc.protocol.serde.reducers import (
    MissingReferenceError,
    ReduceFn,
    ReducerRegistry,
    default_registry,
    register_reducer,
)
from asyncrpc.protocol.serde.tensors import Allocator, Segment

__all__ = [
    "Allocator",
    "Discard",
    "Dumped",
    "MissingReferenceError",
    "PersistentDump",
    "PersistentLoad",
    "ReduceFn",
    "ReducerRegistry",
    "Segment",
    "Serializer",
    "default_registry",
    "pack_exception",
    "register_reducer",
    "unpack_exception",
]
