"""Fuzzing the bytes a stranger controls: the frame decoder and the handshake messages.

Hypothesis builds valid frames, mutates them (flipped bytes, truncation, insertion,
duplication) and feeds them in random chunk sizes, to a decoder in handshake mode under the
pre-auth limits and to one with the normal limits. The only error allowed out is
``RemoteProtocolError`` (the connection is then closed); a valid stream decodes to exactly
what was sent. Every message decoded from fuzzed bytes before authentication is checked to
be a handshake message, and ``decode_message`` on arbitrary arrays raises nothing else.
Fuzzed frames are fed to a ``Network`` alone (no agent above it): none of an
unauthenticated connection reaches its receiver, where payloads are unpickled. The
handshake machine is fed random message sequences directly: it only ever returns actions
or raises protocol errors, and never adopts a connection without a proof.
``FUZZ_EXAMPLES`` sets the number of cases (CI keeps the default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrpc.errors import LocalProtocolError, PeerLostError, RemoteProtocolError
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.handshake import (
    HANDSHAKE_MAX_FRAME,
    Adopt,
    Close,
    Handshake,
    Send,
    State,
    pre_auth_decoder,
)
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.protocol.serde.buffers import ReceiveBuffers
from asyncrpc.protocol.wire import PROTOCOL_VERSION, Frame, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import (
    Auth,
    Hello,
    HelloReply,
    Message,
    Refusal,
    decode_message,
)
from asyncrpc.runtime.group.join import Group
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.network import Network

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=20), st.binary(max_size=40),
)  # fmt: skip
fields_strategy = st.lists(
    st.recursive(scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8), max_size=8
)
segments_strategy = st.lists(
    st.tuples(st.binary(max_size=300), st.sampled_from(["cpu", "cuda:0"])), max_size=3
)
handshake_messages = st.one_of(
    st.builds(Hello, st.just(PROTOCOL_VERSION), st.text(max_size=30), st.integers(0, 64),
              st.binary(min_size=32, max_size=32)),
    st.builds(HelloReply, st.just(PROTOCOL_VERSION), st.text(max_size=30), st.integers(0, 64),
              st.sampled_from(Refusal), st.text(max_size=30), st.binary(max_size=32),
              st.binary(max_size=32)),
    st.builds(Auth, st.binary(min_size=32, max_size=32)),
)  # fmt: skip


def frame_bytes(fields: list[Any], payload: bytes, segments: list[tuple[bytes, str]]) -> bytes:
    views = [(memoryview(data), tag) for data, tag in segments]
    return b"".join(bytes(piece) for piece in encode_frame(fields, payload, views))


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(b"".join(draw(st.lists(frames, min_size=1, max_size=3))))
    for _ in range(draw(st.integers(0, 4))):  # bounded: a few mutations per case
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            data += data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


any_frame = st.builds(frame_bytes, fields_strategy, st.binary(max_size=500), segments_strategy)
handshake_frame = handshake_messages.map(lambda m: frame_bytes(m.to_fields(), b"", []))


def feed_in_chunks(decoder: FrameDecoder, data: bytes, sizes: list[int]) -> list[Any]:
    """Feed ``data``; return the frames, or stop at the first protocol error."""
    frames: list[Any] = []
    pos, i = 0, 0
    try:
        while pos < len(data):  # bounded by len(data): every step consumes >= 1 byte
            size = sizes[i % len(sizes)]
            frames += decoder.feed(data[pos : pos + size])
            frames += _drain(decoder)
            pos, i = pos + size, i + 1
    except RemoteProtocolError:
        pass
    return frames


def _drain(decoder: FrameDecoder) -> list[Any]:
    frames: list[Any] = []
    while decoder.stepwise:  # one frame per pass: collect what is already received
        more = decoder.buffer_updated(0)
        if not more:
            break
        frames += more
    return frames


@FUZZ
@given(mutated(any_frame), st.lists(st.integers(1, 97), min_size=1, max_size=5))
def test_fuzz_FrameDecoder_raises_only_protocol_errors(data: bytes, sizes: list[int]) -> None:
    feed_in_chunks(FrameDecoder(), data, sizes)
    pre_auth = pre_auth_decoder()
    for frame in feed_in_chunks(pre_auth, data, sizes):
        assert len(frame.payload) + sum(len(s) for s in frame.segments) <= HANDSHAKE_MAX_FRAME


@FUZZ
@given(
    st.lists(st.tuples(fields_strategy, st.binary(max_size=500), segments_strategy), max_size=4),
    st.lists(st.integers(1, 97), min_size=1, max_size=5),
)
def test_fuzz_FrameDecoder_valid_stream_decodes_to_what_was_sent(
    sent: list[tuple[list[Any], bytes, list[tuple[bytes, str]]]], sizes: list[int]
) -> None:
    data = b"".join(frame_bytes(*frame) for frame in sent)
    frames = feed_in_chunks(FrameDecoder(), data, sizes)
    got = [(f.fields, bytes(f.payload), [bytes(s) for s in f.segments]) for f in frames]
    expected = [
        (msgpack.unpackb(msgpack.packb(fields)), payload, [d for d, _ in segments])
        for fields, payload, segments in sent
    ]
    assert got == expected


class _UnauthenticatedConnection:
    """A connection whose peer has not authenticated: records what the agent does to it."""

    def __init__(self) -> None:
        self.peer: int | None = None
        self.peer_name: str | None = None
        self.initiated = False
        self.closed = False
        self.goodbye = False
        self.aborted: list[BaseException] = []

    def abort(self, reason: BaseException) -> None:
        self.aborted.append(reason)
        self.closed = True

    def send(self, pieces: Any, keepalive: object = None) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _MustNotReceive:
    """The network's receiver (the agent, which unpickles payloads): a frame of an
    unauthenticated connection must never get here."""

    def on_frame(self, conn: Any, frame: Frame) -> None:
        raise AssertionError(f"a frame of an unauthenticated connection was handed on: {conn}")

    def on_connection_lost(self, rank: int, conn: Any, error: PeerLostError) -> None:
        pass

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        pass

    def on_forks_unsent(self, rank: int, forks: Any) -> None:
        pass

    def on_forks_in_doubt(self, rank: int, forks: Any) -> None:
        pass

    def on_unknown_peer(self, rank: int) -> None:
        pass


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    # Built as after a join, in this process: no rendezvous, no socket, no agent.
    loop = asyncio.new_event_loop()
    addresses = {r: PeerAddress(n, r, "127.0.0.1", 1 + r) for r, n in enumerate(("fuzzed", "w1"))}
    store: Any = None  # no barrier or look-up is reached from a handshake
    group = Group("fuzzed", 0, 2, addresses, b"k" * 32, None, Directory(addresses, None), store)
    yield Network(
        group, RpcBackendOptions(), loop, Counters(), receiver=_MustNotReceive(),
        allocate=ReceiveBuffers().segment, listener=Listener(loop),
    )  # fmt: skip
    loop.close()


@FUZZ
@given(mutated(st.one_of(handshake_frame, any_frame)), st.lists(st.integers(1, 97), min_size=1))
def test_fuzz_Network_unauthenticated_frames_never_reach_its_receiver(
    network: Network, data: bytes, sizes: list[int]
) -> None:
    decoder = pre_auth_decoder()
    for frame in feed_in_chunks(decoder, data, sizes):
        conn = _UnauthenticatedConnection()
        network.on_frame(conn, frame)
        assert conn.peer is None  # nothing here can adopt it: that takes the key's proof
        if not isinstance(_decoded(frame.fields), (Hello, HelloReply, Auth)):
            assert conn.aborted, frame.fields  # anything else closes the connection


def _decoded(fields: list[Any]) -> Message | None:
    try:
        return decode_message(fields)
    except RemoteProtocolError:
        return None


@FUZZ
@given(st.lists(st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)), max_size=9))
def test_fuzz_decode_message_raises_only_protocol_errors(fields: list[Any]) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_message(fields)


def test_fuzz_auth_proof_of_a_mutated_handshake_never_verifies() -> None:
    key, d, a = b"k" * 32, auth.new_nonce(), auth.new_nonce()
    good = auth.proof(key, auth.DIALER, d, a, ("w1", 1), ("w2", 2))
    for i in range(len(good)):  # every single-byte change of the proof is refused
        bad = bytearray(good)
        bad[i] ^= 0x01
        assert not auth.verify(good, bytes(bad))


# -- the handshake machine, fed directly ----------------------------------------------------

KEY = b"k" * 32
ME, PEER = ("w2", 2), ("w1", 1)
refusals = st.one_of(st.none(), st.sampled_from(Refusal))
anything = st.one_of(
    handshake_messages,
    handshake_messages.map(lambda m: _decoded(m.to_fields())),  # as received from the wire
    fields_strategy.map(_decoded),  # whatever random arrays decode to (often None)
    scalars,
)


class _Roster:
    def __init__(self, refusal: Refusal | None, connected: bool) -> None:
        self.answer, self.is_connected = refusal, connected

    def refusal(self, name: str, rank: int) -> Refusal | None:
        return self.answer

    def connected(self, rank: int) -> bool:
        return self.is_connected


def _feed(machine: Handshake, message: object) -> list[Any]:
    """Feed one message: actions, or a protocol error (which must leave ERROR behind)."""
    before = machine.state
    try:
        actions = machine.receive(message)
    except LocalProtocolError:
        assert before is State.ERROR  # the only local error receive() has: fed after failing
        return []
    except RemoteProtocolError:
        assert machine.state is State.ERROR
        return []
    assert all(isinstance(a, Send | Adopt | Close) for a in actions)
    assert machine.state is not State.ERROR
    return actions


@FUZZ
@given(st.booleans(), refusals, st.booleans(), st.lists(anything, max_size=6))
def test_fuzz_Handshake_a_stranger_gets_actions_or_errors_and_never_adoption(
    dialled: bool, refusal: Refusal | None, connected: bool, messages: list[object]
) -> None:
    roster = _Roster(refusal, connected)
    if dialled:
        machine = Handshake.dialer(ME, PEER, KEY, 1 << 20, roster)
        machine.start()
    else:
        machine = Handshake.acceptor(ME, KEY, 1 << 20, roster)
    for message in messages:
        actions = _feed(machine, message)
        # Without the key no proof verifies, so no connection is ever adopted.
        assert not any(isinstance(a, Adopt) for a in actions)
    assert machine.state is not State.OPEN


@FUZZ
@given(st.lists(st.tuples(st.booleans(), st.booleans(), anything), max_size=10))
def test_fuzz_Handshake_a_real_exchange_with_random_messages_thrown_in(
    steps: list[tuple[bool, bool, object]],
) -> None:
    roster = _Roster(None, connected=False)
    dialer = Handshake.dialer(PEER, ME, KEY, 1 << 20, roster)
    acceptor = Handshake.acceptor(ME, KEY, 1 << 30, roster)
    inbox: dict[Handshake, list[object]] = {dialer: [], acceptor: []}
    inbox[acceptor] += [a.message for a in dialer.start() if isinstance(a, Send)]
    adopted = {dialer: 0, acceptor: 0}
    for deliver, to_acceptor, junk in steps:
        machine, other = (acceptor, dialer) if to_acceptor else (dialer, acceptor)
        message = inbox[machine].pop(0) if deliver and inbox[machine] else junk
        for action in _feed(machine, message):
            if isinstance(action, Send):
                inbox[other].append(action.message)
            elif isinstance(action, Adopt):
                adopted[machine] += 1
                assert machine.state is State.OPEN
                assert (action.name, action.rank) == (ME if machine is dialer else PEER)
    assert all(count <= 1 for count in adopted.values())
