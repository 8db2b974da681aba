"""Sans-I/O frame decoder (layer L1): bytes in, ``Frame``s out.

``FrameDecoder`` follows the ``asyncio.BufferedProtocol`` contract (``get_buffer`` /
``buffer_updated``) and receives large parts straight into their destination memory (the
allocator's). Every length is checked against the limits before anything is allocated.
No asyncio, sockets, threads or torch here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final, NoReturn

import msgpack

from asyncrpc.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from asyncrpc.protocol.wire.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_MAX_HEADER_SIZE,
    MAGIC,
    PRELUDE,
    PRELUDE_SIZE,
    PROTOCOL_VERSION,
    Allocator,
    Frame,
    byte_view,
    bytearray_allocator,
)

__all__ = ["FrameDecoder"]

_unpackb: Final = msgpack.unpackb
_EMPTY_OWNER: Final = bytearray()  # placeholder, never written
_NO_SIZES: Final[list[int]] = []  # never mutated

# The generated __init__ of a frozen slotted dataclass goes through object.__setattr__ for
# each field (~650 ns for four); the decoder builds frames through the slot descriptors
# instead (~220 ns). Frames stay frozen for everybody else. The size, known from the
# prelude, is one more slot write: the hooks that report message sizes read it for free.
_FRAME_NEW: Final = object.__new__
_SET_FIELDS: Final[Callable[[Frame, Any], None]] = vars(Frame)["fields"].__set__
_SET_PAYLOAD: Final[Callable[[Frame, Any], None]] = vars(Frame)["payload"].__set__
_SET_SEGMENTS: Final[Callable[[Frame, Any], None]] = vars(Frame)["segments"].__set__
_SET_TAGS: Final[Callable[[Frame, Any], None]] = vars(Frame)["tags"].__set__
_SET_NBYTES: Final[Callable[[Frame, int], None]] = vars(Frame)["nbytes"].__set__


def _new_frame(
    fields: list[Any], payload: bytes | bytearray, segments: list[object], tags: list[str],
    nbytes: int,
) -> Frame:  # fmt: skip
    frame: Frame = _FRAME_NEW(Frame)
    _SET_FIELDS(frame, fields)
    _SET_PAYLOAD(frame, payload)
    _SET_SEGMENTS(frame, segments)
    _SET_TAGS(frame, tags)
    _SET_NBYTES(frame, nbytes)
    return frame


# Decoder states. Staged parts wait whole in the staging buffer; filled parts are copied (or
# received directly) into their own destination memory.
_PRELUDE_STATE: Final = 0
_HEADER_STAGED: Final = 1
_PAYLOAD_STAGED: Final = 2
_DONE: Final = 3
_HEADER_FILL: Final = 4
_PAYLOAD_FILL: Final = 5
_SEGMENT_FILL: Final = 6


def _decode_header(raw: bytearray, buffers_len: int) -> tuple[list[Any], list[int], list[str]]:
    """Unpack and check a header; return its fields, segment sizes and segment tags."""
    try:
        # unpackb caps every length at len(raw) and its C stack caps nesting.
        header = _unpackb(raw, use_list=True, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError...
        raise RemoteProtocolError(f"frame header is not valid msgpack: {exc}") from exc
    if type(header) is not list or not header:
        raise RemoteProtocolError("frame header is not a non-empty msgpack array")
    descs = header.pop()
    if type(descs) is list and not descs and not buffers_len:
        return header, _NO_SIZES, []
    sizes, tags = _check_segments(descs, buffers_len)
    return header, sizes, tags


def _check_segments(descs: object, buffers_len: int) -> tuple[list[int], list[str]]:
    """Validate the header's segment list; return the sizes and tags."""
    if type(descs) is not list:
        raise RemoteProtocolError(f"frame segment list is a {type(descs).__name__}, not a list")
    sizes: list[int] = []
    tags: list[str] = []
    for desc in descs:
        if type(desc) is not list or len(desc) != 2:
            raise RemoteProtocolError("frame segment descriptor is not an [nbytes, tag] pair")
        nbytes, tag = desc
        if type(nbytes) is not int or nbytes < 0 or type(tag) is not str:
            raise RemoteProtocolError(
                f"frame segment descriptor [{nbytes!r}, {tag!r}] is not [int >= 0, str]"
            )
        sizes.append(nbytes)
        tags.append(tag)
    if sum(sizes) != buffers_len:
        raise RemoteProtocolError(
            f"frame segments add up to {sum(sizes)} bytes but the prelude announced {buffers_len}"
        )
    return sizes, tags


class FrameDecoder:
    """Incremental frame decoder following the ``asyncio.BufferedProtocol`` contract.

    Bytes normally land in a fixed staging buffer (allocated once, never grown). A part with
    ``direct_threshold`` bytes or more still missing, and nothing left unread in staging, is
    received straight into its destination: the payload's own bytearray or the allocator's
    memory, so large tensors arrive with no copy at all. Sizes are checked against the limits
    before anything is allocated. After any error the decoder is broken: ``get_buffer``,
    ``buffer_updated`` and ``feed`` raise an error of the same type again.
    """

    __slots__ = (
        "_allocate",
        "_buffers_len",
        "_consumed",
        "_dest",
        "_dest_owner",
        "_dest_pos",
        "_direct",
        "_end",
        "_error",
        "_fields",
        "_header_len",
        "_max_frame_size",
        "_max_header_size",
        "_min_tail",
        "_offered",
        "_owners",
        "_payload",
        "_payload_len",
        "_seg_index",
        "_size",
        "_sizes",
        "_staging",
        "_start",
        "_state",
        "_tags",
        "_threshold",
        "_view",
        "stepwise",
    )

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        allocate: Allocator = bytearray_allocator,
        staging_size: int = 256 * 1024,
        direct_threshold: int = 64 * 1024,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        stepwise: bool = False,
    ) -> None:
        """Create a decoder.

        Args:
            max_frame_size: Largest header + payload + segments accepted, in bytes.
            allocate: Makes the destination memory of each segment.
            staging_size: Size of the reused receive buffer; at least ``PRELUDE_SIZE``.
            direct_threshold: Parts with at least this many bytes missing are received
                straight into their destination; payloads below it are copied out of
                staging. Between 1 and ``staging_size``.
            max_header_size: Largest msgpack header accepted, in bytes.
            stepwise: Return at most one frame per call until ``open``, so that the
                limits can be raised between the frame that authenticates the peer and
                the frames behind it in the same read. Pass small limits with it (the
                handshake's policy: ``asyncrpc.protocol.handshake.pre_auth_decoder``).

        Raises:
            ValueError: The sizes are inconsistent.
        """
        if staging_size < PRELUDE_SIZE or not 1 <= direct_threshold <= staging_size:
            raise ValueError(
                f"need PRELUDE_SIZE <= staging_size and 1 <= direct_threshold <= staging_size "
                f"(got staging_size={staging_size}, direct_threshold={direct_threshold})"
            )
        self._max_frame_size = max_frame_size
        self._max_header_size = max_header_size
        self.stepwise = stepwise
        self._allocate = allocate
        self._threshold = direct_threshold
        self._size = staging_size
        self._min_tail = max(staging_size >> 3, 1)
        self._staging = bytearray(staging_size)
        self._view = memoryview(self._staging)
        # staging[_start:_end] is received but unread; _consumed counts the bytes of the
        # current frame already read out of staging (or received directly).
        self._start = self._end = self._consumed = 0
        self._offered = 0  # length of the last buffer handed out; 0 = none outstanding
        self._direct = False  # the last buffer handed out was destination memory
        self._error: BaseException | None = None
        self._state = _PRELUDE_STATE
        self._header_len = self._payload_len = self._buffers_len = 0
        self._dest: memoryview | None = None
        self._dest_owner = _EMPTY_OWNER  # the header's or payload's own bytearray
        self._dest_pos = 0
        self._fields: list[Any] = []
        self._payload: bytes | bytearray = b""
        self._owners: list[object] = []
        self._sizes: list[int] = []
        self._tags: list[str] = []
        self._seg_index = 0

    def open(self, max_frame_size: int, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        """The peer is authenticated: take frames up to these limits, all at once.

        Bytes already received are parsed on the next ``buffer_updated`` (``0`` will do).
        """
        self._max_frame_size = max_frame_size
        self._max_header_size = max_header_size
        self.stepwise = False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a completed frame."""
        return self._consumed + self._end - self._start

    def at_frame_boundary(self) -> bool:
        """Return True when no partial frame is pending (False once broken); for EOF checks."""
        return self._error is None and self._state == _PRELUDE_STATE and self._end == self._start

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Return the writable memory where the next received bytes go.

        Args:
            sizehint: Ignored (the ``BufferedProtocol`` hint); the buffer is never empty.

        Returns:
            A free region of the staging buffer, or a view straight into the current part's
            destination when at least ``direct_threshold`` bytes of it are missing.

        Raises:
            ProtocolError: The decoder is broken by an earlier error (same type again).
        """
        del sizehint
        if self._error is not None:
            self._raise_broken()
        start = self._start
        if start == self._end:
            dest = self._dest
            if dest is not None and len(dest) - self._dest_pos >= self._threshold:
                view = dest[self._dest_pos :]
                self._direct = True
                self._offered = len(view)
                return view
            self._start = self._end = 0
        elif start:
            # Move the unread tail of a partial staged part (< its size <= staging size)
            # to the front when the free space is small or too small to complete it.
            tail = self._size - self._end
            if tail < self._min_tail or tail < self._staged_need() - (self._end - start):
                self._compact()
        view = self._view[self._end :]
        self._direct = False
        self._offered = len(view)
        return view

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer and parse as far as possible.

        Args:
            nbytes: How many bytes were written into the buffer from ``get_buffer``.

        Returns:
            Every frame completed by these bytes, in order (possibly none).

        Raises:
            RemoteProtocolError: The peer sent a malformed frame (``FrameTooLargeError``
                for one over the limits); the decoder is broken from then on.
            LocalProtocolError: ``nbytes`` does not fit the last buffer handed out, or the
                allocator returned unusable memory.
        """
        if self._error is not None:
            self._raise_broken()
        try:
            if not 0 <= nbytes <= self._offered:
                raise LocalProtocolError(
                    f"buffer_updated({nbytes}) but the last buffer held {self._offered} bytes"
                )
            self._offered = 0
            if self._direct:
                self._dest_pos += nbytes
                self._consumed += nbytes
            else:
                self._end += nbytes
            return self._parse()
        except Exception as exc:
            self._error = exc
            raise

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Copy ``data`` through ``get_buffer``/``buffer_updated``; for tests and plain streams.

        Args:
            data: Received bytes.

        Returns:
            Every frame completed by ``data``, in order.

        Raises:
            RemoteProtocolError: As ``buffer_updated``.
        """
        if self._error is not None:
            self._raise_broken()
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        frames: list[Frame] = []
        pos, total = 0, len(src)
        while pos < total:
            buf = self.get_buffer(total - pos)
            n = min(len(buf), total - pos)  # >= 1: get_buffer never returns an empty view
            buf[:n] = src[pos : pos + n]
            pos += n
            frames += self.buffer_updated(n)
        return frames

    # -- internals ---------------------------------------------------------------------------

    def _raise_broken(self) -> NoReturn:
        error = self._error
        assert error is not None
        try:
            again = copy.copy(error)  # a fresh instance: re-raising one object grows its traceback
        except Exception:
            again = RemoteProtocolError("the frame decoder is broken by an earlier error")
        raise again from error

    def _staged_need(self) -> int:
        state = self._state
        if state == _HEADER_STAGED:
            return self._header_len
        if state == _PAYLOAD_STAGED:
            return self._payload_len
        return PRELUDE_SIZE

    def _compact(self) -> None:
        start, end = self._start, self._end
        self._view[: end - start] = self._view[start:end]
        self._start, self._end = 0, end - start

    def _parse(self) -> list[Frame]:
        """Consume staged bytes as far as they go; return the completed frames."""
        # Longer than our usual 40 lines on purpose: a whole small frame (the common case:
        # many in one recv) is decoded inline here, with no per-part state transitions.
        frames: list[Frame] = []
        staging = self._staging
        view = self._view
        while True:
            if self._state != _PRELUDE_STATE:
                if not self._advance():
                    return frames
                if self._state == _DONE:
                    nbytes = PRELUDE_SIZE + self._header_len + self._payload_len + self._buffers_len
                    frames.append(
                        _new_frame(self._fields, self._payload, self._owners, self._tags, nbytes)
                    )
                    self._state = _PRELUDE_STATE
                    self._consumed = 0
                    if self.stepwise:
                        return frames
                continue
            start = self._start
            end = self._end
            if end - start < PRELUDE_SIZE:
                return frames
            magic, version, flags, reserved, header_len, payload_len, buffers_len = (
                PRELUDE.unpack_from(view, start)
            )
            if (
                magic != MAGIC
                or version != PROTOCOL_VERSION
                or flags
                or reserved
                or header_len + payload_len + buffers_len > self._max_frame_size
                or header_len > self._max_header_size
            ):
                self._reject_prelude(start)
            body = start + PRELUDE_SIZE
            split = body + header_len
            stop = split + payload_len
            if buffers_len or stop > end or payload_len >= self._threshold:
                self._begin_frame(header_len, payload_len, buffers_len)
                continue
            # Fast path: the whole frame is staged and carries no segment bytes (there may
            # still be zero-length segments). A bytearray slice unpacks faster than a view.
            self._start = stop
            fields, sizes, tags = _decode_header(staging[body:split], 0)
            frame = _FRAME_NEW(Frame)  # inlined _new_frame: this is the hottest line
            _SET_FIELDS(frame, fields)
            _SET_PAYLOAD(frame, bytes(view[split:stop]))
            _SET_SEGMENTS(frame, [self._allocate_segment(0, t)[0] for t in tags] if sizes else [])
            _SET_TAGS(frame, tags)
            _SET_NBYTES(frame, stop - start)
            frames.append(frame)
            if self.stepwise:
                return frames

    def _reject_prelude(self, start: int) -> NoReturn:
        """Raise the error that the prelude at ``start`` deserves (it failed a check)."""
        magic, version, flags, reserved, header_len, payload_len, buffers_len = PRELUDE.unpack_from(
            self._view, start
        )
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})"
            )
        if flags or reserved:
            raise RemoteProtocolError(f"reserved prelude bits set (flags={flags}, {reserved})")
        total = header_len + payload_len + buffers_len
        if total > self._max_frame_size:
            raise FrameTooLargeError(total, self._max_frame_size)
        if header_len > self._max_header_size:
            raise RemoteProtocolError(
                f"frame header of {header_len} bytes exceeds the limit of "
                f"{self._max_header_size} bytes"
            )
        raise AssertionError("_reject_prelude called on a valid prelude")  # pragma: no cover

    def _begin_frame(self, header_len: int, payload_len: int, buffers_len: int) -> None:
        """Slow path: consume the prelude and receive the frame part by part."""
        self._start += PRELUDE_SIZE
        self._consumed = PRELUDE_SIZE
        self._header_len = header_len
        self._payload_len = payload_len
        self._buffers_len = buffers_len
        if header_len <= self._size:
            self._state = _HEADER_STAGED
        else:  # larger than staging: it gets its own buffer, like a large payload
            self._begin_fill(_HEADER_FILL, header_len)

    def _advance(self) -> bool:
        """Make progress on the current part; False when more bytes are needed."""
        state = self._state
        if state >= _HEADER_FILL:
            return self._fill()
        start = self._start
        need = self._header_len if state == _HEADER_STAGED else self._payload_len
        if self._end - start < need:
            return False
        self._start = start + need
        self._consumed += need
        if state == _HEADER_STAGED:
            self._read_header(self._staging[start : start + need])
        else:
            self._payload = bytes(self._view[start : start + need])
            self._next_segment()
        return True

    def _read_header(self, raw: bytearray) -> None:
        self._fields, self._sizes, self._tags = _decode_header(raw, self._buffers_len)
        self._owners = []
        self._seg_index = 0
        if self._payload_len < self._threshold:
            self._state = _PAYLOAD_STAGED
        else:
            self._begin_fill(_PAYLOAD_FILL, self._payload_len)

    def _begin_fill(self, state: int, nbytes: int) -> None:
        # Sizes were checked against the limits in _parse before we get here.
        self._dest_owner = bytearray(nbytes)
        self._dest = memoryview(self._dest_owner)
        self._dest_pos = 0
        self._state = state

    def _fill(self) -> bool:
        """Copy staged bytes into the current destination; True when it is complete."""
        dest = self._dest
        assert dest is not None
        pos = self._dest_pos
        n = min(self._end - self._start, len(dest) - pos)
        if n:
            start = self._start
            dest[pos : pos + n] = self._view[start : start + n]
            self._start = start + n
            self._consumed += n
            pos += n
            self._dest_pos = pos
        if pos < len(dest):
            return False
        self._dest = None
        owner, self._dest_owner = self._dest_owner, _EMPTY_OWNER
        state = self._state
        if state == _HEADER_FILL:
            self._read_header(owner)
        else:
            if state == _PAYLOAD_FILL:
                self._payload = owner
            self._next_segment()
        return True

    def _next_segment(self) -> None:
        """Allocate the next non-empty segment and start filling it, or finish the frame."""
        sizes = self._sizes
        index = self._seg_index
        while index < len(sizes):  # bounded by the checked header
            nbytes = sizes[index]
            owner, view = self._allocate_segment(nbytes, self._tags[index])
            self._owners.append(owner)
            index += 1
            if nbytes:
                self._seg_index = index
                self._dest = view
                self._dest_pos = 0
                self._state = _SEGMENT_FILL
                return
        self._seg_index = index
        self._state = _DONE

    def _allocate_segment(self, nbytes: int, tag: str) -> tuple[object, memoryview]:
        owner, view = self._allocate(nbytes, tag)
        if type(view) is not memoryview or view.readonly or view.nbytes != nbytes:
            raise LocalProtocolError(
                f"the allocator must return a writable memoryview of {nbytes} bytes"
            )
        return owner, byte_view(view, "allocated memory")
