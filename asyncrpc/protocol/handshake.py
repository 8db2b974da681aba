"""One connection's authenticated handshake as a sans-I/O state machine (layer L1).

The runtime feeds it the handshake messages a connection receives and performs the actions
it returns (httpcore over h11: read, feed, act, write); it reads no socket and keeps no
clock. It also sets the caps on what is read before the peer proved the key
(``pre_auth_decoder``); the runtime keeps the acceptor's deadline.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from asyncrpc.errors import AuthenticationError, LocalProtocolError, RemoteProtocolError
from asyncrpc.protocol import auth
from asyncrpc.protocol.wire import PROTOCOL_VERSION, FrameDecoder
from asyncrpc.protocol.wire.frame import Allocator, bytearray_allocator
from asyncrpc.protocol.wire.messages import Auth, Hello, HelloReply, Refusal

__all__ = [
    "HANDSHAKE_MAX_FRAME",
    "RACES",
    "Action",
    "Adopt",
    "Close",
    "Handshake",
    "Refusal",
    "Roster",
    "Send",
    "State",
    "pre_auth_decoder",
]

# The largest frame (and header) a connection takes before its peer has authenticated:
# handshake messages are a few dozen bytes; a name may be long, but not this long.
HANDSHAKE_MAX_FRAME: Final = 4096


def pre_auth_decoder(allocate: Allocator = bytearray_allocator) -> FrameDecoder:
    """The decoder of a connection before its peer proved the key: frames and headers
    capped at ``HANDSHAKE_MAX_FRAME``, one frame per read pass, so that ``open`` can lift
    the caps between the frame that authenticates the peer and the frames behind it."""
    return FrameDecoder(
        max_frame_size=HANDSHAKE_MAX_FRAME,
        max_header_size=HANDSHAKE_MAX_FRAME,
        allocate=allocate,
        stepwise=True,
    )


# The protocol. The dialer sends Hello (version, name, rank, nonce, largest frame it takes).
# The acceptor refuses it (HelloReply with a Refusal code), or challenges it: an accepting
# HelloReply with its own nonce and its proof of the group key (see auth.py). The dialer
# checks that proof, sends Auth with its own, and takes the connection as the peer's; the
# acceptor does so once Auth verifies. So each side adopts a connection only after the other
# proved the key, and nothing from the network is unpickled before (the runtime routes no
# other frame here, and adopts only on ``Adopt``). A Refusal is a code; its text is for
# people. TIE_BREAK and ALREADY_CONNECTED are races, not failures: the acceptor leaves the
# closing to the dialer, which retries or waits for the peer's own dial.


class State(enum.Enum):
    DIALLED = "dialled"  # dialer, before start()
    AWAITING_REPLY = "awaiting reply"  # dialer: Hello sent
    ACCEPTED = "accepted"  # acceptor, before the Hello
    CHALLENGED = "challenged"  # acceptor: accepting HelloReply sent, Auth awaited
    OPEN = "open"  # authenticated: the runtime takes over the connection
    CLOSING = "closing"  # refused, or another connection won: this one carries nothing
    ERROR = "error"  # the peer broke the protocol or failed the proof


class _Outcome(enum.Enum):
    SENT = "sent"
    ACCEPTED = "accepted"  # proofs and checks passed
    REFUSED = "refused"
    SUPERSEDED = "superseded"  # valid, but another connection to that peer won


# Every transition, in one table: (state, what happened) -> {outcome: next state}. "What
# happened" is the message received, or "start" for the dialer's first move. A pair not in
# the table is out of order: the peer's fault (RemoteProtocolError) and the machine's end.
_TRANSITIONS: Final[dict[tuple[State, object], dict[_Outcome, State]]] = {
    (State.DIALLED, "start"): {_Outcome.SENT: State.AWAITING_REPLY},
    (State.AWAITING_REPLY, HelloReply): {
        _Outcome.ACCEPTED: State.OPEN,
        _Outcome.REFUSED: State.CLOSING,
        _Outcome.SUPERSEDED: State.CLOSING,
    },
    (State.ACCEPTED, Hello): {_Outcome.ACCEPTED: State.CHALLENGED, _Outcome.REFUSED: State.CLOSING},
    (State.CHALLENGED, Auth): {_Outcome.ACCEPTED: State.OPEN, _Outcome.SUPERSEDED: State.CLOSING},
}

_REFUSAL_TEXT: Final = {
    Refusal.VERSION: "protocol version {version} is not supported (this side speaks {ours})",
    Refusal.UNKNOWN_WORKER: "no worker named {name!r} has rank {rank} in this group",
    Refusal.LOST: "declared lost",
    Refusal.ALREADY_CONNECTED: "already connected",
    Refusal.TIE_BREAK: "both sides dialled; the connection dialled by the lower rank is kept",
}
# Races: the dialer closes the connection (and retries, or waits for the peer's dial).
RACES: Final = frozenset({Refusal.ALREADY_CONNECTED, Refusal.TIE_BREAK})


class Roster(Protocol):
    """What the machine asks of this worker's view of the group (the peer table)."""

    def refusal(self, name: str, rank: int) -> Refusal | None:
        """Why a dialer claiming ``(name, rank)`` may not connect now; None if it may."""
        ...

    def connected(self, rank: int) -> bool:
        """Whether ``rank`` already has an authenticated connection."""
        ...


@dataclass(frozen=True, slots=True)
class Send:
    """Write this handshake message on the connection."""

    message: Hello | HelloReply | Auth


@dataclass(frozen=True, slots=True)
class Adopt:
    """The peer proved the key: lift the pre-auth limits; the connection is ``rank``'s."""

    rank: int
    name: str
    max_frame_size: int  # the largest frame the peer takes (0: not said)


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection once written. ``refusal`` says why (NONE: another connection
    to that peer won); ``reason`` says it in words."""

    refusal: Refusal
    reason: str = ""


Action = Send | Adopt | Close


class Handshake:
    """The handshake of one connection, for the side that dialled it or accepted it.

    Make one with ``dialer`` or ``acceptor``; the dialer calls ``start`` once, then both
    feed every message received before the connection is open to ``receive``.
    """

    def __init__(
        self,
        state: State,
        me: tuple[str, int],
        key: bytes,
        max_frame_size: int,
        roster: Roster,
        peer: tuple[str, int] | None,
        new_nonce: Callable[[], bytes],
    ) -> None:
        self.state = state
        self._me = me
        self._key = key
        self._max_frame_size = max_frame_size
        self._roster = roster
        self.peer = peer  # the (name, rank) dialled, or claimed by the dialer's Hello
        self._new_nonce = new_nonce
        self._nonces = (b"", b"")  # (dialer's, acceptor's)
        self._expected = b""  # the acceptor's expected proof from the dialer
        self._peer_max_frame = 0

    @classmethod
    def dialer(
        cls,
        me: tuple[str, int],
        peer: tuple[str, int],
        key: bytes,
        max_frame_size: int,
        roster: Roster,
        new_nonce: Callable[[], bytes] = auth.new_nonce,
    ) -> Handshake:
        """The machine of a connection this side dialled to ``peer`` (name, rank)."""
        return cls(State.DIALLED, me, key, max_frame_size, roster, peer, new_nonce)

    @classmethod
    def acceptor(
        cls,
        me: tuple[str, int],
        key: bytes,
        max_frame_size: int,
        roster: Roster,
        new_nonce: Callable[[], bytes] = auth.new_nonce,
    ) -> Handshake:
        """The machine of a connection this side accepted."""
        return cls(State.ACCEPTED, me, key, max_frame_size, roster, None, new_nonce)

    @property
    def peer_rank(self) -> int | None:
        return None if self.peer is None else self.peer[1]

    def start(self) -> list[Action]:
        """The dialer's first move: its Hello.

        Returns:
            The actions to perform, in order.

        Raises:
            LocalProtocolError: not a dialer, or started already; the state is unchanged.
        """
        if (self.state, "start") not in _TRANSITIONS:
            raise LocalProtocolError(f"cannot start a handshake in state {self.state.name}")
        nonce = self._new_nonce()
        self._nonces = (nonce, b"")
        name, rank = self._me
        self._move("start", _Outcome.SENT)
        return [Send(Hello(PROTOCOL_VERSION, name, rank, nonce, self._max_frame_size))]

    def receive(self, message: object) -> list[Action]:
        """Feed one message the peer sent before the connection was open.

        Args:
            message: a decoded message (any kind: one that is not expected now is an error).

        Returns:
            The actions to perform, in order.

        Raises:
            RemoteProtocolError: the peer broke the protocol (``AuthenticationError``: it
                failed the proof); the machine is then in ERROR, and the connection must
                be closed.
            LocalProtocolError: this side fed a machine that had already failed.
        """
        if self.state is State.ERROR:
            raise LocalProtocolError("the handshake already failed")
        if (self.state, type(message)) not in _TRANSITIONS:
            error = f"unexpected {type(message).__name__} in handshake state {self.state.name}"
            self.state = State.ERROR
            raise RemoteProtocolError(error)
        try:
            if isinstance(message, Hello):
                outcome, actions = self._on_hello(message)
            elif isinstance(message, HelloReply):
                outcome, actions = self._on_reply(message)
            else:
                assert isinstance(message, Auth)
                outcome, actions = self._on_auth(message)
        except RemoteProtocolError:
            self.state = State.ERROR
            raise
        except Exception as exc:  # a check met data it cannot handle: the peer's fault
            self.state = State.ERROR
            raise RemoteProtocolError(f"bad {type(message).__name__}: {exc}") from exc
        self._move(type(message), outcome)
        return actions

    def _move(self, event: object, outcome: _Outcome) -> None:
        self.state = _TRANSITIONS[(self.state, event)][outcome]

    # -- the acceptor ----------------------------------------------------------------------

    def _on_hello(self, hello: Hello) -> tuple[_Outcome, list[Action]]:
        self.peer = (hello.name, hello.rank)
        if hello.version != PROTOCOL_VERSION:
            refusal: Refusal | None = Refusal.VERSION
        else:
            refusal = self._roster.refusal(hello.name, hello.rank)
        name, rank = self._me
        if refusal is not None:
            text = _REFUSAL_TEXT[refusal].format(
                version=hello.version, ours=PROTOCOL_VERSION, name=hello.name, rank=hello.rank
            )
            actions: list[Action] = [Send(HelloReply(PROTOCOL_VERSION, name, rank, refusal, text))]
            if refusal not in RACES:
                actions.append(Close(refusal, text))
            return _Outcome.REFUSED, actions
        nonce = self._new_nonce()
        self._nonces = (hello.nonce, nonce)
        dialer = (hello.name, hello.rank)
        mine = auth.proof(self._key, auth.ACCEPTOR, hello.nonce, nonce, dialer, self._me)
        self._expected = auth.proof(self._key, auth.DIALER, hello.nonce, nonce, dialer, self._me)
        self._peer_max_frame = hello.max_frame_size
        reply = HelloReply(
            PROTOCOL_VERSION, name, rank, Refusal.NONE, "", nonce, mine, self._max_frame_size
        )
        return _Outcome.ACCEPTED, [Send(reply)]

    def _on_auth(self, message: Auth) -> tuple[_Outcome, list[Action]]:
        assert self.peer is not None
        name, rank = self.peer
        if not auth.verify(self._expected, message.proof):
            raise AuthenticationError(
                f"a dialer claiming to be {name!r} gave a wrong proof of the group key"
            )
        if self._roster.connected(rank):
            return _Outcome.SUPERSEDED, [Close(Refusal.NONE, "another connection won")]
        return _Outcome.ACCEPTED, [Adopt(rank, name, self._peer_max_frame)]

    # -- the dialer ------------------------------------------------------------------------

    def _on_reply(self, reply: HelloReply) -> tuple[_Outcome, list[Action]]:
        assert self.peer is not None
        name, rank = self.peer
        if not reply.accepted:
            return _Outcome.REFUSED, [Close(reply.refusal, reply.reason)]
        if self._roster.connected(rank):
            # The peer's own dial was adopted meanwhile: the first authenticated connection
            # wins on both sides (the peer drops its challenge when this one closes).
            return _Outcome.SUPERSEDED, [Close(Refusal.NONE, "another connection won")]
        if reply.version != PROTOCOL_VERSION:
            raise RemoteProtocolError(f"{name!r} answered in protocol version {reply.version}")
        if (reply.name, reply.rank) != self.peer:
            raise RemoteProtocolError(f"dialled rank {rank}, rank {reply.rank} answered")
        nonce = self._nonces[0]
        acceptor = (reply.name, reply.rank)
        expected = auth.proof(self._key, auth.ACCEPTOR, nonce, reply.nonce, self._me, acceptor)
        if not auth.verify(expected, reply.proof):
            raise AuthenticationError(f"{name!r} gave a wrong proof of the group key")
        proof = auth.proof(self._key, auth.DIALER, nonce, reply.nonce, self._me, acceptor)
        # Adopt at once, not when a dial task next runs: the peer may send a request right
        # behind its reply, in the same read.
        return _Outcome.ACCEPTED, [Send(Auth(proof)), Adopt(rank, name, reply.max_frame_size)]
