"""Sans-I/O wire protocol of asyncrpc (layer L1): frames in and out, no I/O, no torch.

Re-exports the frame codec; see ``asyncrpc.protocol.wire.frame`` (format, encoder) and
``asyncrpc.protocol.wire.decoder``.
"""

from __future__ import annotations

from asyncrpc.protocol.wire.decoder import FrameDecoder
from asyncrpc.protocol.wire.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_MAX_HEADER_SIZE,
    MAGIC,
    PRELUDE_SIZE,
    PROTOCOL_VERSION,
    Allocator,
    Frame,
    body_nbytes,
    bytearray_allocator,
    encode_frame,
    frame_nbytes,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_HEADER_SIZE",
    "MAGIC",
    "PRELUDE_SIZE",
    "PROTOCOL_VERSION",
    "Allocator",
    "Frame",
    "FrameDecoder",
    "body_nbytes",
    "bytearray_allocator",
    "encode_frame",
    "frame_nbytes",
]
