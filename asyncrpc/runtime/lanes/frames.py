"""Frames over one blocking socket, read and written by the thread that owns it (layer L2.46).

A lane is driven by one thread at a time, in blocking I/O: the GIL is released while the
thread waits in ``recv_into`` or ``sendmsg``, and no event loop takes part. The frames are
the wire's own (``protocol/wire``): the same sans-I/O decoder parses them, with the same
caps before the peer authenticated.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

import torch

from asyncrpc.errors import ClosedError, ConnectionLostError, FrameTooLargeError
from asyncrpc.protocol.serde.tensors import memory_view
from asyncrpc.protocol.wire import PRELUDE_SIZE, Frame, FrameDecoder, frame_nbytes

__all__ = ["FIGURES", "BlockingFrames", "Unsent", "figures", "lane_allocate", "retire"]

# A lane's figures that outlive it (summed over open lanes and those closed before).
FIGURES = ("bytes_in", "bytes_out", "polls", "poll_hits")

_UINT8 = torch.uint8
_KERNEL_TIMEOUTS = sys.platform == "linux"  # struct timeval is two longs there
_TIMEVAL = struct.Struct("@ll")
_SEND_TIMEOUT = socket.SO_SNDTIMEO
_READABLE = select.POLLIN


def lane_allocate(nbytes: int, tag: str) -> tuple[object, memoryview]:
    """Receive memory for a segment on a lane: a fresh uint8 tensor and a view of its bytes.

    The serializer's own allocator pools large buffers for the loop's thread only; lanes
    carry small messages, and each thread gets its memory from torch directly.
    """
    del tag  # the bytes land in CPU memory; the unpickler moves them where the tag says
    owner = torch.empty(nbytes, dtype=_UINT8)
    return owner, memory_view(owner.data_ptr(), nbytes, writable=True)


def figures(frames: list[BlockingFrames], retired: dict[str, int]) -> dict[str, int]:
    """``FIGURES`` summed over ``frames`` (open lanes) and ``retired`` (closed ones)."""
    return {key: retired[key] + sum(getattr(f, key) for f in frames) for key in FIGURES}


def retire(frames: BlockingFrames, retired: dict[str, int]) -> None:
    """Add a closing lane's ``FIGURES`` to ``retired``."""
    for key in FIGURES:
        retired[key] += getattr(frames, key)


class Unsent(Exception):
    """Not one byte of the frame was written (the socket broke, or the lane was closed,
    before): whatever it asked for cannot have happened. ``reason`` is the lane's error."""

    def __init__(self, reason: Exception) -> None:
        super().__init__(reason)
        self.reason = reason


class BlockingFrames:
    """One socket and its decoder: ``write`` whole frames, ``read`` the next one.

    Not thread-safe: one thread uses it at a time (the lane's owner). ``close`` may come
    from any thread: a thread blocked in ``read`` then wakes with ``ClosedError``.
    """

    def __init__(self, sock: socket.socket, decoder: FrameDecoder, max_frame_size: int) -> None:
        self.sock = sock
        self.decoder = decoder
        self.max_frame_size = max_frame_size  # what it takes once the peer authenticated
        self.peer_max_frame = 0  # what the peer takes (0: not said), known once open
        self.peer_name: str | None = None
        self._frames: list[Frame] = []
        self.closed = False
        # Seconds ``read`` polls the socket before it sleeps in ``recv_into`` (0: never; the
        # ``busy_poll_us`` option). Polling trades CPU for the wake-up of a sleeping
        # thread, which costs 20-30 µs on a virtual machine (bench/RESULTS.md).
        self.spin = 0.0
        self.polls = self.poll_hits = 0  # reads that polled; those a frame ended in time
        # The socket's timeout now: switching it costs system calls, so it is switched
        # only when a deadline starts or ends (a call without one keeps it blocking).
        self._timeout: float | None = sock.gettimeout()
        self._armed: dict[int, float] = {}  # option -> the kernel timeout set (see _budget)
        self._readable = select.poll()  # what read sleeps in (see _wait_readable)
        self._readable.register(sock.fileno(), _READABLE)
        # The poll holds the fd's number: it must not be closed (and reused) while a
        # reader polls it. ``close`` from another thread then only shuts the socket down,
        # which wakes the reader, and the reader closes the fd (see _wait_readable).
        self._fd_lock = threading.Lock()
        self._polling = False
        self.bytes_in = self.bytes_out = 0  # written by the owning thread only

    def open(self, peer_name: str, peer_max_frame: int) -> None:
        """The peer proved the key: lift the decoder's caps, and parse the frames already
        received behind the one that authenticated it."""
        self.peer_name, self.peer_max_frame = peer_name, peer_max_frame
        self.decoder.open(self.max_frame_size)
        self._frames.extend(self.decoder.buffer_updated(0))

    def check_size(self, pieces: list[Any]) -> int:
        """The frame's size in bytes.

        Raises:
            FrameTooLargeError: it is over the peer's limit (nothing was written).
        """
        size = frame_nbytes(pieces)
        limit = self.peer_max_frame
        if limit and size - PRELUDE_SIZE > limit:
            raise FrameTooLargeError(size - PRELUDE_SIZE, limit, self.peer_name)
        return size

    def write(self, pieces: list[Any], deadline: float | None = None) -> None:
        """Write one frame's pieces, whole (partial sends are resumed).

        Raises:
            Unsent: nothing was written (the socket broke, or the deadline passed, first).
            ClosedError: the lane was closed in the middle of the frame.
            ConnectionLostError: the socket broke in the middle of the frame.
            TimeoutError: ``deadline`` passed with the frame partly written (the lane is
                closed: nothing can follow a frame cut short).
        """
        views: list[Any] = list(pieces)  # bytes and byte views (``encode_frame``'s pieces)
        started = False
        try:
            while views:  # bounded: each pass sends at least one byte, or by the deadline
                self._budget(deadline, _SEND_TIMEOUT)
                try:
                    sent = self.sock.sendmsg(views)
                except BlockingIOError:  # the kernel's send timeout: is the deadline past?
                    continue
                started = True
                self.bytes_out += sent
                while views and sent >= len(views[0]):
                    sent -= len(views.pop(0))
                if sent:
                    views[0] = memoryview(views[0])[sent:]
        except OSError as exc:
            if started:  # a frame cut short: nothing more can follow it on this socket
                self.close()
                raise self._broken("writing", exc) from exc
            raise Unsent(self._broken("writing", exc)) from exc

    def read(self, deadline: float | None = None) -> Frame:
        """The next frame; blocks until it is complete or ``deadline`` passes.

        Raises:
            TimeoutError: ``deadline`` passed first (the lane stays usable: a frame cut
                short is completed by the next read).
            ClosedError: the lane was closed.
            ConnectionLostError: the peer closed the socket, or it broke.
            RemoteProtocolError: the peer sent a malformed frame.
        """
        frames = self._frames
        decoder = self.decoder
        if not frames and self.spin > 0:
            self.polls += 1
            self._poll(deadline)
            self.poll_hits += bool(frames)
        if not _KERNEL_TIMEOUTS:
            return self._read_with_timeouts(deadline)
        self._blocking()
        while not frames:  # bounded by the deadline, or by the peer closing
            self._wait_readable(deadline)
            buffer = decoder.get_buffer()
            try:
                nbytes = self.sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:  # woken for nothing after all: wait again
                continue
            except OSError as exc:
                raise self._broken("reading", exc) from exc
            self._received(nbytes)
        return frames.pop(0)

    # A thread that sleeps in a blocking ``recv`` on a Unix socket is woken each time the
    # peer reads what this side wrote: the kernel wakes every sleeper on the socket when
    # its send buffer drains, a receiver too, and the receiver finds nothing and sleeps
    # again. A lane reads its reply right after writing the request, so each call cost
    # the caller a wake-up for nothing when the callee read the request, and the callee
    # one when the caller read the reply (perf's sched_switch: 8.5 sleeps in recv per 6
    # recv calls in a training step). ``poll`` for POLLIN is woken by data only.
    def _wait_readable(self, deadline: float | None) -> None:
        """Sleep until the socket has data, is closed or broke, or ``deadline`` passes.

        Raises:
            TimeoutError: the deadline passed.
            ClosedError: the lane was closed.
        """
        timeout = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the lane's deadline passed")
            timeout = math.ceil(left * 1000)
        with self._fd_lock:
            if self.closed:  # its fd may be closed, its number another file's by now
                raise ClosedError("the lane was closed")
            self._polling = True
        try:
            ready = self._readable.poll(timeout)
        finally:
            with self._fd_lock:
                self._polling = False
                if self.closed:  # closed while we polled: the fd is ours to close
                    self.sock.close()
        if not ready and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the lane's deadline passed")

    def _read_with_timeouts(self, deadline: float | None) -> Frame:
        # Where the kernel's timeouts are not used: a Python socket timeout, which polls.
        frames, decoder = self._frames, self.decoder
        while not frames:  # bounded by the deadline, or by the peer closing
            self._wait_budget(deadline)
            buffer = decoder.get_buffer()
            try:
                nbytes = self.sock.recv_into(buffer)
            except OSError as exc:  # a TimeoutError is raised as it is
                raise self._broken("reading", exc) from exc
            self._received(nbytes)
        return frames.pop(0)

    def _received(self, nbytes: int) -> None:
        """Parse ``nbytes`` just read into the decoder's buffer (0: the peer closed)."""
        if nbytes == 0:
            raise self._broken("reading", None)
        self.bytes_in += nbytes
        self._frames.extend(self.decoder.buffer_updated(nbytes))

    def _poll(self, deadline: float | None) -> None:
        """Read what has arrived without sleeping, for ``spin`` seconds at most (or until
        ``deadline``) or until a frame is whole. The GIL is released in each ``recv_into``.
        """
        frames, decoder, sock = self._frames, self.decoder, self.sock
        end = time.monotonic() + self.spin
        if deadline is not None:
            end = min(end, deadline)
        self._blocking()  # MSG_DONTWAIT then never sleeps
        buffer = decoder.get_buffer()
        while time.monotonic() < end:  # bounded by ``end``
            try:
                nbytes = sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue  # nothing yet
            except OSError as exc:
                raise self._broken("reading", exc) from exc
            self._received(nbytes)
            if frames:
                return
            buffer = decoder.get_buffer()

    # On Linux a write's deadline is the kernel's SO_SNDTIMEO on a blocking socket, set
    # again only when a call's budget does not fit the one set for an earlier call: calls
    # with the same timeout make no system call for it. (A Python socket timeout costs an
    # ioctl to set for each call and a poll before every send and receive.) The kernel's
    # timeout ends a blocking send with EAGAIN, and ``write`` then asks here whether the
    # deadline passed. A call without a deadline leaves the timeout set: its wait wakes
    # once per that many seconds and sleeps again. A read waits in ``_wait_readable``.
    def _budget(self, deadline: float | None, option: int) -> None:
        if not _KERNEL_TIMEOUTS:
            self._wait_budget(deadline)
            return
        self._blocking()
        if deadline is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the lane's deadline passed")
        armed = self._armed.get(option, 0.0)
        if armed and left <= armed <= left + max(left / 20, 0.002):
            return  # it ends at most 5% (or 2 ms) after this deadline
        total = int(left * 1e6) + 1  # whole µs, rounded up: never 0, which means "none"
        self.sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(*divmod(total, 1_000_000)))
        self._armed[option] = total / 1e6

    def _blocking(self) -> None:
        """Drop a Python socket timeout (a dial's): the socket blocks, and a Python
        timeout would poll before each call (and make MSG_DONTWAIT wait)."""
        if self.sock.gettimeout() is not None:
            self.sock.settimeout(None)
            self._timeout = None

    def _wait_budget(self, deadline: float | None) -> None:
        if deadline is None:
            if self._timeout is not None:
                self.sock.settimeout(None)
                self._timeout = None
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the lane's deadline passed")
        self.sock.settimeout(left)
        self._timeout = left

    def _broken(self, doing: str, exc: OSError | None) -> Exception:
        if isinstance(exc, TimeoutError):
            return exc
        if self.closed:
            return ClosedError("the lane was closed")
        what = "the peer closed the connection" if exc is None else f"{exc}"
        return ConnectionLostError(f"lane broke while {doing}: {what}")

    def close(self) -> None:
        """Close the socket; a thread blocked on it wakes up (any thread may call this)."""
        with self._fd_lock:
            if self.closed:
                return
            self.closed = True
            polling = self._polling
        with contextlib.suppress(OSError):  # not connected any more: closing is enough
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader in poll, or in recv
        if not polling:  # else the reader closes it as it wakes (see _wait_readable)
            self.sock.close()
