"""A staged frame as parts that may be written one after another as their chunks' copies
complete (layer L2.45): what lets the socket write of a large tensor overlap its copy to the
host, for a writer that can send one frame in several writes.

``split_frame`` cuts a frame's pieces at the staged chunks' byte ranges (found by address:
a segment is a view of the pinned buffer its tensor was copied into) and gives each part
the events its bytes wait for; ``frame_parts`` yields the parts in order, each once its
events are done, polling like ``SendGate`` (never blocking the loop). Bytes no chunk
covers (the prelude, header, pickle, CPU tensors) travel with the part after them, and
the first part waits for the first chunk: nothing of a frame leaves before its first
chunk is on the host, and no byte of a chunk before its copy is done.

``StagedTransfer.ready`` hands a frame of several chunks to the links as ``StagedParts``
(a ``links.FrameInParts``); ``links.write_in_parts`` writes its parts with nothing else on
the connection in between and checks the frame's size against the peer's limit first.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator, Sequence

from asyncrpc.runtime.cuda.devices import Devices, Event
from asyncrpc.runtime.cuda.gate import FIRST_POLL_S, MAX_POLL_S

__all__ = ["Part", "address_of", "frame_parts", "split_frame"]

Piece = bytes | memoryview
# One part of a frame: its pieces, and the events to wait for before they are written.
Part = tuple[list[Piece], tuple[Event, ...]]
Chunk = tuple[int, int, Event]  # host bytes [start, stop) by address, valid after the event


class _Buffer(ctypes.Structure):  # CPython's Py_buffer, enough of it to read `buf`
    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_Buffer),)
_release_buffer.restype = None


def address_of(piece: memoryview) -> int:
    """The address of the first byte of a contiguous memoryview (read-only ones too)."""
    buffer = _Buffer()
    _get_buffer(piece, ctypes.byref(buffer), 0)  # PyBUF_SIMPLE; raises on failure
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


def split_frame(pieces: Sequence[Piece], chunks: Sequence[Chunk]) -> list[Part]:
    """``pieces`` cut at the chunks' boundaries, grouped into parts: each starts with the
    bytes of one chunk and runs up to the next chunk's; bytes before the first chunk join
    the first part. With no chunk among the pieces, one part that waits for nothing."""
    ordered = sorted(chunks, key=lambda chunk: chunk[0])
    parts: list[Part] = []
    head: list[Piece] = []  # bytes before the first chunk
    for piece in pieces:
        for sub, event in _cut(piece, ordered):
            if event is not None:
                parts.append(([*head, sub], (event,)))
                head = []
            elif parts:
                parts[-1][0].append(sub)
            else:
                head.append(sub)
    if head:
        parts.append((head, ()))
    return parts


def _cut(piece: Piece, chunks: Sequence[Chunk]) -> list[tuple[Piece, Event | None]]:
    # A piece's sub-views, each inside one chunk (with its event) or outside all (None).
    if not isinstance(piece, memoryview) or piece.nbytes == 0:
        return [(piece, None)]
    view = piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece
    start = address_of(view)
    stop = start + view.nbytes
    out: list[tuple[Piece, Event | None]] = []
    at = start
    for low, high, event in chunks:  # sorted by address, disjoint
        if high <= at or low >= stop:
            continue
        if low > at:
            out.append((view[at - start : low - start], None))
            at = low
        end = min(high, stop)
        out.append((view[at - start : end - start], event))
        at = end
    if at < stop:
        out.append((view[at - start :], None))
    return out


async def frame_parts(
    devices: Devices, parts: Sequence[Part], *, first_poll: float = FIRST_POLL_S,
    max_poll: float = MAX_POLL_S,
) -> AsyncIterator[list[Piece]]:  # fmt: skip
    """Yield each part's pieces, in order, once its events are done (polled on the loop
    with a growing backoff; a part whose events are done is yielded at once). Cancelling
    stops it: the parts not yet yielded are not written."""
    for pieces, events in parts:  # each wait lasts as long as the GPU work
        delay = first_poll
        while not all(devices.done(event) for event in events):
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_poll)
        yield pieces
