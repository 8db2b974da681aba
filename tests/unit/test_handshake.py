"""Unit tests of asyncrpc.protocol.handshake: both roles driven directly, no loop, no agent."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from asyncrpc.errors import (
    AuthenticationError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from asyncrpc.protocol import auth
from asyncrpc.protocol.handshake import (
    RACES,
    Action,
    Adopt,
    Close,
    Handshake,
    Refusal,
    Send,
    State,
)
from asyncrpc.protocol.wire import PROTOCOL_VERSION
from asyncrpc.protocol.wire.messages import (
    Auth,
    Goodbye,
    Hello,
    HelloReply,
    Request,
    decode_message,
)

KEY = b"k" * 32
DIALER, ACCEPTOR = ("w1", 1), ("w2", 2)
D_MAX, A_MAX = 1 << 20, 1 << 30


class FakeRoster:
    """The peer table's answers, set by each test."""

    def __init__(self, refusal: Refusal | None = None, connected: bool = False) -> None:
        self.answer = refusal
        self.is_connected = connected
        self.asked: list[tuple[str, int]] = []

    def refusal(self, name: str, rank: int) -> Refusal | None:
        self.asked.append((name, rank))
        return self.answer

    def connected(self, rank: int) -> bool:
        return self.is_connected


def fresh_nonces(tag: bytes) -> Callable[[], bytes]:
    """Distinct, recognisable nonces of auth.NONCE_SIZE bytes."""
    counter = itertools.count()
    return lambda: tag + bytes([next(counter) % 256]) * (auth.NONCE_SIZE - 1)


def dialer(key: bytes = KEY, roster: FakeRoster | None = None) -> Handshake:
    roster = roster or FakeRoster()
    return Handshake.dialer(DIALER, ACCEPTOR, key, D_MAX, roster, fresh_nonces(b"d"))


def acceptor(key: bytes = KEY, roster: FakeRoster | None = None) -> Handshake:
    return Handshake.acceptor(ACCEPTOR, key, A_MAX, roster or FakeRoster(), fresh_nonces(b"a"))


def sent(actions: list[Action]) -> Hello | HelloReply | Auth:
    assert isinstance(actions[0], Send), actions
    return actions[0].message


def test_Handshake_happy_path_opens_both_sides() -> None:
    d, a = dialer(), acceptor()
    hello = sent(d.start())
    assert isinstance(hello, Hello)
    assert (hello.name, hello.rank, hello.max_frame_size) == (*DIALER, D_MAX)
    assert d.state is State.AWAITING_REPLY
    assert a.state is State.ACCEPTED

    replied = a.receive(hello)
    reply = sent(replied)
    assert len(replied) == 1
    assert isinstance(reply, HelloReply)
    assert reply.accepted
    assert a.state is State.CHALLENGED
    assert a.peer == DIALER

    answered = d.receive(reply)
    proof = sent(answered)
    assert isinstance(proof, Auth)
    assert answered[1:] == [Adopt(ACCEPTOR[1], ACCEPTOR[0], A_MAX)]
    assert d.state is State.OPEN

    assert a.receive(proof) == [Adopt(DIALER[1], DIALER[0], D_MAX)]
    assert a.state is State.OPEN


def test_Handshake_messages_survive_the_wire() -> None:
    d, a = dialer(), acceptor()
    hello = decode_message(sent(d.start()).to_fields())
    reply = decode_message(sent(a.receive(hello)).to_fields())
    proof = decode_message(sent(d.receive(reply)).to_fields())
    assert isinstance(a.receive(proof)[0], Adopt)


@pytest.mark.parametrize(
    "refusal",
    [Refusal.UNKNOWN_WORKER, Refusal.LOST, Refusal.ALREADY_CONNECTED, Refusal.TIE_BREAK],
)
def test_Handshake_acceptor_refuses_with_the_roster_code(refusal: Refusal) -> None:
    roster = FakeRoster(refusal)
    d, a = dialer(), acceptor(roster=roster)
    actions = a.receive(sent(d.start()))
    reply = sent(actions)
    assert isinstance(reply, HelloReply)
    assert reply.refusal is refusal
    assert not reply.accepted
    assert reply.reason
    assert reply.proof == b""
    assert reply.nonce == b""
    assert roster.asked == [DIALER]
    # Races leave the closing to the dialer; real refusals close at once.
    closes = [] if refusal in RACES else [Close(refusal, reply.reason)]
    assert actions[1:] == closes
    assert a.state is State.CLOSING
    assert d.receive(reply) == [Close(refusal, reply.reason)]
    assert d.state is State.CLOSING


def test_Handshake_acceptor_refuses_another_protocol_version() -> None:
    roster = FakeRoster()
    a = acceptor(roster=roster)
    actions = a.receive(Hello(PROTOCOL_VERSION + 1, *DIALER, b"n" * 32))
    reply = sent(actions)
    assert isinstance(reply, HelloReply)
    assert reply.refusal is Refusal.VERSION
    assert actions[1:] == [Close(Refusal.VERSION, reply.reason)]
    assert roster.asked == []  # the version is checked first
    assert a.state is State.CLOSING


def test_Handshake_dialer_rejects_a_reply_in_another_version() -> None:
    d, a = dialer(), acceptor()
    reply = sent(a.receive(sent(d.start())))
    assert isinstance(reply, HelloReply)
    other = HelloReply(PROTOCOL_VERSION + 1, *ACCEPTOR, Refusal.NONE, "", reply.nonce, reply.proof)
    with pytest.raises(RemoteProtocolError):
        d.receive(other)
    assert d.state is State.ERROR


def test_Handshake_dialer_rejects_a_reply_from_someone_else() -> None:
    d, a = dialer(), Handshake.acceptor(("w3", 3), KEY, A_MAX, FakeRoster())
    reply = sent(a.receive(sent(d.start())))
    with pytest.raises(RemoteProtocolError) as info:
        d.receive(reply)
    assert not isinstance(info.value, AuthenticationError)
    assert d.state is State.ERROR


def test_Handshake_wrong_key_fails_the_dialer_on_the_reply() -> None:
    d, a = dialer(), acceptor(key=b"x" * 32)
    reply = sent(a.receive(sent(d.start())))
    with pytest.raises(AuthenticationError):
        d.receive(reply)
    assert d.state is State.ERROR


def test_Handshake_wrong_key_fails_the_acceptor_on_the_auth() -> None:
    # A dialer without the key cannot answer the challenge: a made-up proof is refused.
    d, a = dialer(), acceptor()
    reply = sent(a.receive(sent(d.start())))
    assert isinstance(reply, HelloReply)
    with pytest.raises(AuthenticationError):
        a.receive(Auth(b"\0" * 32))
    assert a.state is State.ERROR
    # Nor does a proof of these very nonces made with another key.
    d2, a2 = dialer(), acceptor()
    hello = sent(d2.start())
    reply2 = sent(a2.receive(hello))
    assert isinstance(hello, Hello)
    assert isinstance(reply2, HelloReply)
    forged = auth.proof(b"x" * 32, auth.DIALER, hello.nonce, reply2.nonce, DIALER, ACCEPTOR)
    with pytest.raises(AuthenticationError):
        a2.receive(Auth(forged))
    # Nor the right key's proof of another handshake (the nonces differ).
    d3, a3 = dialer(), acceptor()
    other = sent(d3.receive(sent(a3.receive(sent(d3.start())))))
    a4 = acceptor()
    a4.receive(Hello(PROTOCOL_VERSION, *DIALER, b"n" * 32))
    with pytest.raises(AuthenticationError):
        a4.receive(other)


def test_Handshake_a_late_winner_closes_quietly() -> None:
    # The peer's own connection was adopted meanwhile: this one closes, on either side.
    roster = FakeRoster()
    d, a = dialer(roster=roster), acceptor()
    reply = sent(a.receive(sent(d.start())))
    roster.is_connected = True
    assert d.receive(reply) == [Close(Refusal.NONE, "another connection won")]
    assert d.state is State.CLOSING

    roster2 = FakeRoster()
    d2, a2 = dialer(), acceptor(roster=roster2)
    proof2 = sent(d2.receive(sent(a2.receive(sent(d2.start())))))
    roster2.is_connected = True
    assert a2.receive(proof2) == [Close(Refusal.NONE, "another connection won")]
    assert a2.state is State.CLOSING


@pytest.mark.parametrize(
    ("make", "feed"),
    [
        ("acceptor", "auth"),  # Auth before Hello
        ("acceptor", "reply"),  # the acceptor never takes a HelloReply
        ("dialer", "reply"),  # a reply before this side said Hello
        ("dialer", "hello"),  # the dialer never takes a Hello
        ("dialer", "auth"),
    ],
)
def test_Handshake_out_of_order_messages_are_remote_errors(make: str, feed: str) -> None:
    machine = acceptor() if make == "acceptor" else dialer()
    message = {
        "auth": Auth(b"p" * 32),
        "reply": HelloReply(PROTOCOL_VERSION, *ACCEPTOR, Refusal.NONE, "", b"n" * 32, b"p" * 32),
        "hello": Hello(PROTOCOL_VERSION, *DIALER, b"n" * 32),
    }[feed]
    with pytest.raises(RemoteProtocolError):
        machine.receive(message)
    assert machine.state is State.ERROR


def test_Handshake_duplicate_messages_are_remote_errors() -> None:
    def opened() -> tuple[Handshake, Handshake, list[Hello | HelloReply | Auth]]:
        d, a = dialer(), acceptor()
        hello = sent(d.start())
        reply = sent(a.receive(hello))
        proof = sent(d.receive(reply))
        a.receive(proof)
        return d, a, [hello, reply, proof]

    d, a, (hello, reply, proof) = opened()
    challenged = acceptor()
    challenged.receive(hello)
    a2 = opened()[1]
    for machine, message in ((challenged, hello), (d, reply), (a2, hello), (a, proof)):
        with pytest.raises(RemoteProtocolError):
            machine.receive(message)
        assert machine.state is State.ERROR
    with pytest.raises(LocalProtocolError):  # feeding a failed machine is this side's bug
        a.receive(proof)


@pytest.mark.parametrize(
    "garbage",
    [
        object(),
        b"\x00\x01",
        None,
        Request(1, 0.0, 0, "fn"),  # type: ignore[arg-type]
        Goodbye("bye"),
        7,
    ],
)
def test_Handshake_garbage_is_a_remote_error(garbage: object) -> None:
    for machine in (acceptor(), dialer()):
        with pytest.raises(RemoteProtocolError):
            machine.receive(garbage)
        assert machine.state is State.ERROR


def test_Handshake_an_Auth_whose_proof_is_not_bytes_fails_authentication() -> None:
    a = acceptor()
    a.receive(Hello(PROTOCOL_VERSION, *DIALER, b"n" * 32))
    with pytest.raises(AuthenticationError):
        a.receive(Auth(12345))  # type: ignore[arg-type]


def test_Handshake_start_is_the_dialers_and_once() -> None:
    d = dialer()
    d.start()
    with pytest.raises(LocalProtocolError):
        d.start()
    assert d.state is State.AWAITING_REPLY  # a local error changes nothing
    a = acceptor()
    with pytest.raises(LocalProtocolError):
        a.start()
    assert a.state is State.ACCEPTED


def test_Handshake_errors_are_protocol_errors_of_the_right_side() -> None:
    assert issubclass(AuthenticationError, RemoteProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert issubclass(LocalProtocolError, ProtocolError)


def test_HelloReply_refusal_is_a_code_on_the_wire() -> None:
    reply = HelloReply(PROTOCOL_VERSION, *ACCEPTOR, Refusal.TIE_BREAK, "any words at all")
    fields = reply.to_fields()
    assert fields[4] == int(Refusal.TIE_BREAK)
    assert type(fields[4]) is int
    back = decode_message(fields)
    assert isinstance(back, HelloReply)
    assert back.refusal is Refusal.TIE_BREAK
    fields[4] = 99  # an unknown code
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)
    fields[4] = True  # a bool is not a code
    with pytest.raises(RemoteProtocolError):
        decode_message(fields)
