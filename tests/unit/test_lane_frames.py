"""Lanes without a worker: frames over a blocking socket pair, and the lane handshake
driven by two threads (``asyncrpc/runtime/lanes/``)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrpc.errors import (
    AuthenticationError,
    ClosedError,
    ConnectionLostError,
    FrameTooLargeError,
    RemoteProtocolError,
)
from asyncrpc.protocol.handshake import pre_auth_decoder
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Ack, Cancel, Reply, decode_message
from asyncrpc.runtime.lanes.client import Lane
from asyncrpc.runtime.lanes.frames import BlockingFrames, Unsent, lane_allocate
from asyncrpc.runtime.lanes.handshake import LaneRoster, Opened, accept_lane, dial_lane

pytestmark = pytest.mark.timeout(30)

KEY = b"k" * 32


@pytest.fixture
def pair() -> Iterator[tuple[BlockingFrames, BlockingFrames]]:
    a, b = socket.socketpair()
    left = BlockingFrames(a, FrameDecoder(allocate=lane_allocate), 1 << 20)
    right = BlockingFrames(b, FrameDecoder(allocate=lane_allocate), 1 << 20)
    yield left, right
    left.close()
    right.close()


def test_BlockingFrames_round_trip_with_a_segment(pair: tuple[Any, Any]) -> None:
    left, right = pair
    segment = memoryview(bytes(range(256)) * 64)
    left.write(encode_frame(Cancel(7).to_fields(), b"payload", [(segment, "cpu")]))
    frame = right.read(time.monotonic() + 5)
    assert decode_message(frame.fields) == Cancel(7)
    assert bytes(frame.payload) == b"payload"
    assert bytes(memoryview(frame.segments[0].numpy())) == bytes(segment)  # type: ignore[attr-defined]
    assert left.bytes_out == right.bytes_in > len(segment)


def test_BlockingFrames_frames_cut_in_pieces_are_joined(pair: tuple[Any, Any]) -> None:
    left, right = pair
    wire = b"".join(bytes(p) for p in encode_frame(Ack(3).to_fields(), b"x" * 1000))
    for i in range(0, len(wire), 7):  # the socket delivers the frame 7 bytes at a time
        left.sock.sendall(wire[i : i + 7])
    assert decode_message(right.read(time.monotonic() + 5).fields) == Ack(3)


def test_BlockingFrames_read_times_out_and_stays_usable(pair: tuple[Any, Any]) -> None:
    left, right = pair
    with pytest.raises(TimeoutError):
        right.read(time.monotonic() + 0.05)
    left.write(encode_frame(Ack(1).to_fields(), b""))
    assert decode_message(right.read(time.monotonic() + 5).fields) == Ack(1)


def test_BlockingFrames_deadlines_of_any_length_follow_each_other(pair: tuple[Any, Any]) -> None:
    left, right = pair
    # A long budget, then a short one: the short one is kept, not the timeout set before.
    left.write(encode_frame(Ack(1).to_fields(), b""))
    assert decode_message(right.read(time.monotonic() + 5).fields) == Ack(1)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        right.read(started + 0.05)
    assert time.monotonic() - started < 1.0
    # No deadline after a short one: the wait outlasts the timeout left set, unharmed.
    writer = threading.Timer(0.3, lambda: left.write(encode_frame(Ack(2).to_fields(), b"")))
    writer.start()
    try:
        assert decode_message(right.read().fields) == Ack(2)
    finally:
        writer.join()
    # The same budget twice, and a write with one: each still holds.
    for call in (3, 4):
        left.write(encode_frame(Ack(call).to_fields(), b""), time.monotonic() + 5)
        assert decode_message(right.read(time.monotonic() + 5).fields) == Ack(call)


def test_BlockingFrames_poll_reads_a_frame_that_comes_within_it(pair: tuple[Any, Any]) -> None:
    left, right = pair
    right.spin = 5.0  # long: the frame comes well within it
    writer = threading.Timer(0.05, lambda: left.write(encode_frame(Ack(5).to_fields(), b"")))
    writer.start()
    try:
        assert decode_message(right.read(time.monotonic() + 10).fields) == Ack(5)
    finally:
        writer.join()
    assert (right.polls, right.poll_hits) == (1, 1)


def test_BlockingFrames_poll_then_sleeps_for_a_late_frame(pair: tuple[Any, Any]) -> None:
    left, right = pair
    right.spin = 0.01
    writer = threading.Timer(0.2, lambda: left.write(encode_frame(Ack(6).to_fields(), b"")))
    writer.start()
    try:
        assert decode_message(right.read(time.monotonic() + 10).fields) == Ack(6)
    finally:
        writer.join()
    assert (right.polls, right.poll_hits) == (1, 0)
    left.write(encode_frame(Ack(7).to_fields(), b"x" * 100_000))  # in pieces, polled
    assert decode_message(right.read(time.monotonic() + 10).fields) == Ack(7)
    assert right.polls == 2


def test_BlockingFrames_poll_keeps_the_deadline(pair: tuple[Any, Any]) -> None:
    _, right = pair
    right.spin = 5.0
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        right.read(started + 0.1)
    assert time.monotonic() - started < 2.0  # the deadline, not the poll's 5 s


def test_BlockingFrames_poll_sees_the_peer_close(pair: tuple[Any, Any]) -> None:
    left, right = pair
    right.spin = 5.0
    threading.Timer(0.05, left.sock.close).start()
    with pytest.raises(ConnectionLostError):
        right.read(time.monotonic() + 10)


def test_Lane_call_takes_an_Ack_read_before_its_reply_as_the_forks_accepted(
    pair: tuple[Any, Any],
) -> None:
    # A remote() sent on the lane earlier (call 5) carried the caller's own fork; the
    # owner's Ack comes ahead of the next call's reply. The owner registered the fork
    # before it wrote the Ack: the RRef layer is told so at once (its ForkAccepted on the
    # loop's connection may come after this call returned, to_here() say).
    left, right = pair
    told: list[tuple[int, list[Any]]] = []
    lane = Lane(left, 3, "w3", lambda rank, forks: told.append((rank, forks)))
    lane.remotes[5] = [("rref", "fork")]
    right.write(encode_frame(Ack(5).to_fields(), b""))
    right.write(encode_frame(Reply(6).to_fields(), b"payload"))
    value, error, _ = lane.call(6, encode_frame(Ack(0).to_fields(), b""), 5.0,
                                lambda payload, segments, **_: bytes(payload))  # fmt: skip
    assert (value, error) == (b"payload", None)
    assert told == [(3, [("rref", "fork")])]
    assert lane.remotes == {}


def _voluntary_switches() -> int:
    with open("/proc/thread-self/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/thread-self")
def test_BlockingFrames_a_reader_sleeps_until_data_not_until_its_writes_drain(
    pair: tuple[Any, Any],
) -> None:
    # A lane writes its request, then reads the reply. On a Unix socket a thread asleep
    # in recv() was also woken when the peer read the request (its send buffer drained),
    # only to sleep again: two sleeps per reply. It must sleep once.
    left, right = pair
    request = encode_frame(Ack(1).to_fields(), b"request")
    sleeps: list[int] = []

    def peer() -> None:
        for _ in range(10):
            right.read(time.monotonic() + 10)
            time.sleep(0.02)  # the request is drained: the caller must not wake for that
            right.write(encode_frame(Ack(2).to_fields(), b"reply"))

    thread = threading.Thread(target=peer)
    thread.start()
    for _ in range(10):
        left.write(request)
        before = _voluntary_switches()
        assert decode_message(left.read(time.monotonic() + 10).fields) == Ack(2)
        sleeps.append(_voluntary_switches() - before)
    thread.join(10)
    assert sorted(sleeps)[len(sleeps) // 2] == 1, sleeps  # the median: the GIL may add one


def test_BlockingFrames_a_close_under_a_polling_reader_leaves_the_fd_to_it(
    pair: tuple[Any, Any],
) -> None:
    # The reader's poll holds the fd's number: closed under it, the number could be
    # reused by another socket at once, and the reader would wait on that one. close()
    # only shuts the socket down then; the reader wakes, closes the fd and stops.
    left, _ = pair
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            left.read()
        except ClosedError as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(500):  # bounded: 5 s for the reader to reach its poll
        if left._polling:
            break
        time.sleep(0.01)
    assert left._polling
    left.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1
    assert left.sock.fileno() == -1  # closed, by the reader
    # With no reader, close() closes the fd itself.
    a, b = socket.socketpair()
    idle = BlockingFrames(a, FrameDecoder(allocate=lane_allocate), 1 << 20)
    idle.close()
    assert a.fileno() == -1
    b.close()


def test_BlockingFrames_close_wakes_a_blocked_reader(pair: tuple[Any, Any]) -> None:
    _, right = pair
    errors: list[BaseException] = []

    def read() -> None:
        try:
            right.read()
        except Exception as exc:  # the observation is the error
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)  # let it block in recv (a wake-up works either way)
    right.close()
    reader.join(5)
    assert not reader.is_alive()
    assert isinstance(errors[0], ClosedError)


def test_BlockingFrames_peer_gone_is_a_lost_connection(pair: tuple[Any, Any]) -> None:
    left, right = pair
    left.close()
    with pytest.raises(ConnectionLostError):
        right.read(time.monotonic() + 5)


def test_BlockingFrames_write_to_a_closed_peer_is_unsent(pair: tuple[Any, Any]) -> None:
    left, right = pair
    right.close()
    with pytest.raises(Unsent):  # a socket pair whose peer closed refuses every byte
        left.write(encode_frame(Ack(1).to_fields(), b""))


def test_BlockingFrames_checks_the_peers_limit_before_writing(pair: tuple[Any, Any]) -> None:
    left, _ = pair
    left.peer_max_frame, left.peer_name = 100, "w1"
    with pytest.raises(FrameTooLargeError) as info:
        left.check_size(encode_frame(Ack(1).to_fields(), b"x" * 200))
    assert info.value.worker == "w1"
    assert left.bytes_out == 0


# -- the handshake, both roles on two threads ----------------------------------------------


def _listen() -> tuple[socket.socket, str]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"\0asyncrpc-test-lane-{time.monotonic_ns()}"
    server.bind(path)
    server.listen(1)
    return server, path


def _both(
    dial_key: bytes, roster: LaneRoster, dial_as: tuple[str, int] = ("w0", 0)
) -> tuple[Any, Any]:
    """Dial and accept at once; each side's Opened or error."""
    server, path = _listen()
    accepted: list[Any] = []

    def accept() -> None:
        sock, _ = server.accept()
        try:
            accepted.append(accept_lane(sock, ("w1", 1), KEY, 1 << 20, roster, 5.0))
        except Exception as exc:  # the observation is the error
            accepted.append(exc)

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        dialled: Any = dial_lane(path, dial_as, ("w1", 1), dial_key, 1 << 20, 5.0)
    except Exception as exc:  # the observation is the error
        dialled = exc
    acceptor.join(10)
    server.close()
    return dialled, accepted[0]


def _roster() -> LaneRoster:
    return LaneRoster({0: "w0", 1: "w1"}.get, lambda rank: False)


def test_lane_handshake_both_sides_adopt_with_the_key() -> None:
    dialled, accepted = _both(KEY, _roster())
    assert isinstance(dialled, Opened)
    assert isinstance(accepted, Opened)
    assert (dialled.rank, dialled.name, accepted.rank, accepted.name) == (1, "w1", 0, "w0")
    # Frames flow both ways once open, with the caps lifted.
    dialled.frames.write(encode_frame(Ack(5).to_fields(), b"y" * 10_000))
    assert decode_message(accepted.frames.read(time.monotonic() + 5).fields) == Ack(5)
    # The dial's own timeout (5 s) is gone: a call's shorter deadline holds on the lane.
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        dialled.frames.read(started + 0.1)
    assert time.monotonic() - started < 2.0
    dialled.frames.close()
    accepted.frames.close()


def test_lane_handshake_wrong_key_is_refused_on_both_sides() -> None:
    dialled, accepted = _both(b"x" * 32, _roster())
    assert isinstance(dialled, AuthenticationError)  # the acceptor's proof fails here
    assert isinstance(accepted, (AuthenticationError, ConnectionLostError))


def test_lane_handshake_a_stranger_name_is_refused() -> None:
    dialled, accepted = _both(KEY, _roster(), dial_as=("mallory", 0))
    assert isinstance(dialled, ConnectionLostError)
    assert "refused" in str(dialled)
    assert isinstance(accepted, (ConnectionLostError, RemoteProtocolError))


def test_lane_handshake_a_lost_worker_is_refused() -> None:
    dialled, _ = _both(KEY, LaneRoster({0: "w0", 1: "w1"}.get, lambda rank: rank == 0))
    assert isinstance(dialled, ConnectionLostError)


def test_lane_handshake_caps_reads_before_the_key() -> None:
    # The acceptor's decoder takes handshake-sized frames only until the peer proved the key.
    decoder = pre_auth_decoder(lane_allocate)
    huge = b"".join(bytes(p) for p in encode_frame(Ack(1).to_fields(), b"z" * 10_000))
    with pytest.raises(RemoteProtocolError):
        decoder.feed(huge)
