"""One TCP connection between two workers, driving the sans-I/O frame decoder (layer L2.2).

``Connection`` is an ``asyncio.BufferedProtocol``: the decoder hands out the memory the
kernel writes into (its staging buffer, or a tensor's own storage for big segments), so
received bytes are copied at most once and tensor bytes never. Frames go to a handler (the
``Network``; before the join, the listener); frames are written whole with ``writelines``
so payloads and tensors are not joined.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from asyncrpc.errors import ClosedError, FrameTooLargeError, ProtocolError
from asyncrpc.protocol.wire import PRELUDE_SIZE, Frame, FrameDecoder, frame_nbytes

__all__ = [
    "Connection",
    "ConnectionHandler",
    "open_connection",
    "open_unix_connection",
    "start_server",
    "start_unix_server",
]

_log = logging.getLogger(__name__)


class ConnectionHandler(Protocol):
    """What a connection reports to (the ``Network``, or the listener before the join)."""

    def on_frame(self, conn: Connection, frame: Frame) -> None: ...

    def on_connection_lost(self, conn: Connection, exc: BaseException | None) -> None: ...

    def on_protocol_error(self, conn: Connection, exc: ProtocolError) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """A framed, multiplexed connection to one peer.

    Attributes:
        peer: the peer's rank once the handshake is done, else None.
        initiated: True when this side dialled the connection.
        bytes_in / bytes_out: byte counters for metrics.
    """

    def __init__(
        self,
        handler: ConnectionHandler,
        decoder: FrameDecoder,
        *,
        initiated: bool,
    ) -> None:
        self._handler = handler
        self._decoder = decoder
        self._transport: asyncio.Transport | None = None
        self._write_paused = False
        self._closed = False
        # Tensors whose memory the transport may still be writing from (see send()).
        self._keepalive: list[object] = []
        # While a frame is written in parts (see begin_parts), the frames sent meanwhile
        # wait here, whole and in order (None: no frame in parts).
        self._held: list[tuple[Sequence[bytes | memoryview], object]] | None = None
        self.initiated = initiated
        self.peer: int | None = None
        self.peer_name: str | None = None
        self.goodbye = False  # the peer said it is closing on purpose
        # Frames of calls received (not the network's own): the idle closer's sign of use.
        self.frames_in = 0
        # Closing for idleness (net/idle.py): None, "asked" (this side asked and wrote its
        # last frame here) or "closing" (agreed: closed by this side or about to be).
        self.idle: str | None = None
        self.peer_max_frame = 0  # the largest frame the peer takes (handshake; 0: unknown)
        self.is_unix = False  # a Unix socket (a peer on this host), not TCP
        self.bytes_in = 0
        self.bytes_out = 0
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio protocol callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        self.is_unix = sock is not None and sock.family == socket.AF_UNIX
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small RPC frames must not wait for Nagle's algorithm.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A high-water mark of 0 makes the transport call pause_writing() whenever anything
        # stays buffered and resume_writing() once all is flushed: that tells us exactly when
        # the tensor memory behind a zero-copy write may be released.
        self._transport.set_write_buffer_limits(high=0)
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        decoder, handler = self._decoder, self._handler
        while True:  # once, unless stepwise (handshaking): one frame per pass (bounded by bytes)
            stepwise = decoder.stepwise
            try:
                frames = decoder.buffer_updated(nbytes)
            except ProtocolError as exc:
                handler.on_protocol_error(self, exc)
                self.abort(exc)
                return
            for frame in frames:
                handler.on_frame(self, frame)
            if not stepwise or not frames or self.closed:
                return
            nbytes = 0  # parse what is already received, under the limits now in force

    def hand_over(self, handler: ConnectionHandler) -> None:
        """From now on, report to ``handler`` (a listener hands its parked connections over)."""
        self._handler = handler

    def open(self, max_frame_size: int) -> None:
        """The peer is authenticated: lift the handshake's limits on this connection."""
        self._decoder.open(max_frame_size)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._keepalive.clear()
        if not self.connected.done():
            self.connected.set_exception(exc or ClosedError("connection closed"))
        self._handler.on_connection_lost(self, exc or self._abort_reason)

    _abort_reason: BaseException | None = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._keepalive.clear()

    # -- our API ---------------------------------------------------------------------------

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has been received and the rest has not."""
        return not self._decoder.at_frame_boundary()

    @property
    def closed(self) -> bool:
        return self._closed or self._transport is None or self._transport.is_closing()

    def send(self, pieces: Sequence[bytes | memoryview], keepalive: object = None) -> None:
        """Write one whole frame. Must run on the loop thread.

        Args:
            pieces: the frame, as ``encode_frame`` returns it.
            keepalive: what keeps the memory of zero-copy pieces valid; held until the
                transport has flushed them.

        Raises:
            ClosedError: the connection is closed.
            FrameTooLargeError: the frame is over the peer's limit; nothing was written.
        """
        transport = self._open_transport()
        size = self.check_size(pieces)
        if self._held is not None:  # a frame is going out in parts: this one goes after it
            self._held.append((pieces, keepalive))
            return
        self.bytes_out += size
        self._write(transport, pieces, keepalive)

    def check_size(self, pieces: Sequence[bytes | memoryview]) -> int:
        """The frame's size in bytes.

        Raises:
            FrameTooLargeError: it is over the peer's limit.
        """
        size = frame_nbytes(pieces)
        limit = self.peer_max_frame
        if limit and size - PRELUDE_SIZE > limit:
            raise FrameTooLargeError(size - PRELUDE_SIZE, limit, self.peer_name)
        return size

    # A frame in parts: for a large frame whose later bytes are still being produced (a
    # CUDA tensor copied to the host chunk by chunk), so that the socket write of its first
    # chunks overlaps the copy of the next ones. Nothing else is written on the connection
    # between two parts: frames sent meanwhile are held and follow the last part in order.

    @property
    def in_parts(self) -> bool:
        """Whether a frame is being written in parts now."""
        return self._held is not None

    def begin_parts(self) -> None:
        """Start writing a frame in parts (on the loop; one at a time). Check its size
        first (``check_size``): a frame cut short cannot be taken back."""
        self._open_transport()
        assert self._held is None, "one frame in parts at a time"
        self._held = []

    def send_part(self, pieces: Sequence[bytes | memoryview], keepalive: object = None) -> None:
        """Write the next part of the frame begun with ``begin_parts``.

        Raises:
            ClosedError: the connection is closed (the frame is lost with it).
        """
        transport = self._open_transport()
        self.bytes_out += frame_nbytes(pieces)
        self._write(transport, pieces, keepalive)

    def end_parts(self, complete: bool) -> None:
        """The frame's last part was written (``complete``), or it will not be: then the
        connection is aborted (the peer must not read a frame cut short). Frames held
        meanwhile go now, in order."""
        held, self._held = self._held, None
        if not complete:
            self.abort(ClosedError("a frame written in parts was cut short"))
            return
        for pieces, keepalive in held or ():
            try:
                self.send(pieces, keepalive)
            except ClosedError:
                return  # the rest go with the connection, as any unsent frame

    def _open_transport(self) -> asyncio.Transport:
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            raise ClosedError(f"connection to {self.peer_name or 'peer'} is closed")
        return transport

    def _write(
        self, transport: asyncio.Transport, pieces: Sequence[bytes | memoryview], keepalive: object
    ) -> None:
        transport.writelines(pieces)
        if self._write_paused and keepalive is not None:
            self._keepalive.append(keepalive)

    def abort(self, reason: BaseException) -> None:
        """Close at once (a protocol error): pending writes are dropped."""
        _log.warning("closing connection to %s: %s", self.peer_name or "peer", reason)
        self._abort_reason = reason
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        """Close after the pending writes are flushed."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


async def start_server(
    host: str,
    factory: Callable[[], Connection],
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[asyncio.Server, int]:
    """Listen on ``host:port`` (0: a free port); return the server and the bound port.

    With ``ssl_context``, every accepted connection is TLS (its handshake runs before the
    protocol sees a byte).
    """
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        factory, host, port, reuse_address=True, backlog=1024, ssl=ssl_context
    )
    bound = server.sockets[0].getsockname()[1]
    return server, int(bound)


async def open_connection(
    host: str,
    port: int,
    factory: Callable[[], Connection],
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """Dial ``host:port`` (over TLS with ``ssl_context``); return the connected protocol.

    Raises:
        OSError: the connection could not be made (``ssl.SSLError`` is one).
    """
    loop = asyncio.get_running_loop()
    hostname = None if ssl_context is None else host
    _, protocol = await loop.create_connection(
        factory, host, port, ssl=ssl_context, server_hostname=hostname
    )
    return protocol


async def start_unix_server(path: str, factory: Callable[[], Connection]) -> asyncio.AbstractServer:
    """Listen on the Unix socket ``path`` (a leading NUL: Linux's abstract namespace, which
    leaves no file behind)."""
    # Bound here, not by the loop: uvloop refuses abstract-namespace paths, Python's socket
    # module takes them.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1024)
        sock.setblocking(False)
        return await asyncio.get_running_loop().create_unix_server(factory, sock=sock)
    except BaseException:
        sock.close()
        raise


async def open_unix_connection(path: str, factory: Callable[[], Connection]) -> Connection:
    """Dial the Unix socket ``path``; return the connected protocol.

    Raises:
        OSError: nothing listens there (another host, container or network namespace).
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, path)
        _, protocol = await loop.create_unix_connection(factory, sock=sock)
    except BaseException:
        sock.close()
        raise
    return protocol
