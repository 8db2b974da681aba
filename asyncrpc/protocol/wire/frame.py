"""Sans-I/O frame format and encoder: prelude + msgpack header + payload + raw segments
(layer L1).

``encode_frame`` turns a header, a payload and tensor segments into pieces for
``transport.writelines``; the decoder (``decoder.py``) turns bytes back into ``Frame``s.
No asyncio, sockets, threads or torch here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgpack

from asyncrpc.errors import LocalProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_HEADER_SIZE",
    "MAGIC",
    "PRELUDE",
    "PRELUDE_SIZE",
    "PROTOCOL_VERSION",
    "U32_LIMIT",
    "Allocator",
    "Frame",
    "body_nbytes",
    "byte_view",
    "bytearray_allocator",
    "encode_frame",
]

MAGIC: Final = b"ARPC"
PROTOCOL_VERSION: Final = 3  # 2: the authenticated handshake; 3: coded calls, stream values
# magic, version, flags, reserved, header_len, payload_len, buffers_len (network byte order).
PRELUDE: Final = struct.Struct("!4sBBHIIQ")
PRELUDE_SIZE: Final = PRELUDE.size  # 24
# 4 GiB: larger than any one message of a usual training job, small enough that a bug or a
# bad peer cannot make a worker allocate tens of GiB for one frame. The handshake tells each
# side the other's limit, so an oversized message fails at its sender, before any byte.
DEFAULT_MAX_FRAME_SIZE: Final = 1 << 32
# msgpack can turn one header byte into one Python object (an empty dict is ~64 bytes), so
# the header gets its own, much smaller limit than the frame: 16 MiB of header is at most
# about 1 GiB of Python objects, and still room for ~300k tensor descriptors.
DEFAULT_MAX_HEADER_SIZE: Final = 16 << 20
U32_LIMIT: Final = 1 << 32

Allocator = Callable[[int, str], tuple[object, memoryview]]
"""``(nbytes, tag) -> (owner, writable 1-D unsigned-byte memoryview of exactly nbytes)``."""

# msgpack.Packer objects keep an internal buffer and are not thread safe, and encode_frame is
# called from several threads; a fresh Packer per call is safe and, measured, ~1.8x faster
# than msgpack.packb (which builds one too, but through **kwargs).
_Packer: Final = msgpack.Packer
_NO_SEGMENTS: Final[list[Any]] = []  # packed, never mutated


def bytearray_allocator(nbytes: int, tag: str) -> tuple[object, memoryview]:
    """Allocate a segment as a ``bytearray`` (the default ``Allocator``).

    Args:
        nbytes: Size of the segment in bytes.
        tag: Where the segment lives on the sender (ignored: everything lands in host memory).

    Returns:
        The bytearray (the owner the frame keeps) and a writable memoryview over it.
    """
    del tag
    buf = bytearray(nbytes)
    return buf, memoryview(buf)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame.

    Attributes:
        fields: The header array without its trailing segment list.
        payload: The payload bytes; owned by the frame (never a view of decoder memory).
        segments: The allocator's owners, one per segment, in order.
        tags: The sender's tag of each segment (e.g. ``"cpu"`` or ``"cuda:0"``).
        nbytes: The frame's size on the wire, prelude included (the decoder reads it from
            the prelude; 0 for a frame built by hand). Not part of equality.
    """

    fields: list[Any]
    payload: bytes | bytearray | memoryview
    segments: list[object]
    tags: list[str]
    nbytes: int = field(default=0, compare=False)


def byte_view(view: memoryview, what: str) -> memoryview:
    """Return ``view`` as a 1-D unsigned-byte memoryview, refusing non-contiguous memory."""
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        raise LocalProtocolError(f"{what} must be C-contiguous memory")
    return view.cast("B")


def frame_nbytes(pieces: Sequence[bytes | memoryview]) -> int:
    """How many bytes the pieces of a frame (or of a part of one) hold."""
    size = 0
    for piece in pieces:
        size += piece.nbytes if isinstance(piece, memoryview) else len(piece)
    return size


def body_nbytes(
    payload: bytes | bytearray | memoryview, segments: Sequence[tuple[memoryview, str]] = ()
) -> int:
    """The size the frame of ``payload`` and ``segments`` will have, less its msgpack
    header: what is known of a reply before the hooks have written its header fields."""
    size = PRELUDE_SIZE + (payload.nbytes if isinstance(payload, memoryview) else len(payload))
    for view, _ in segments:
        size += view.nbytes if isinstance(view, memoryview) else len(view)
    return size


def encode_frame(
    fields: Sequence[Any],
    payload: bytes | bytearray | memoryview,
    segments: Sequence[tuple[memoryview, str]] = (),
) -> list[bytes | memoryview]:
    """Encode one frame as the pieces to hand to ``transport.writelines``.

    Nothing is copied but the header: the payload object and every segment view are returned
    as they are (segment views cast to unsigned bytes when needed). Empty pieces are left out.
    Safe to call from several threads at once.

    Args:
        fields: The header fields (msgpack-serializable); the segment list is appended.
        payload: The payload bytes (a pickle; opaque here).
        segments: ``(view, tag)`` per raw segment, in order; a view must be C-contiguous.

    Returns:
        ``[prelude+header, payload, *segments]`` with empty pieces skipped.

    Raises:
        LocalProtocolError: A field cannot be packed, a segment is not contiguous or a tag is
            not a string, or the header or payload is 4 GiB or larger.
    """
    if type(payload) is memoryview:
        payload = byte_view(payload, "the payload")
    elif type(payload) is bytearray:
        payload = memoryview(payload)  # no copy; keeps the piece types bytes | memoryview
    payload_len = len(payload)
    views: list[memoryview] = []
    buffers_len = 0
    try:
        if segments:
            descs = []
            for view, tag in segments:
                if type(tag) is not str:
                    raise LocalProtocolError(f"segment tag must be a str, not {type(tag)!r}")
                mv = byte_view(view if type(view) is memoryview else memoryview(view), "a segment")
                descs.append((len(mv), tag))
                buffers_len += len(mv)
                views.append(mv)
            header = _Packer().pack([*fields, descs])
        else:
            header = _Packer().pack([*fields, _NO_SEGMENTS])
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot pack the frame header: {exc}") from exc
    header_len = len(header)
    if header_len >= U32_LIMIT or payload_len >= U32_LIMIT:
        raise LocalProtocolError(
            f"frame header ({header_len} bytes) and payload ({payload_len} bytes) must each "
            "be under 4 GiB; send large data as segments"
        )
    pieces: list[bytes | memoryview] = [
        PRELUDE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, header_len, payload_len, buffers_len) + header
    ]
    if payload_len:
        pieces.append(cast("bytes | memoryview", payload))  # bytearray became a view above
    for mv in views:
        if len(mv):
            pieces.append(mv)
    return pieces
