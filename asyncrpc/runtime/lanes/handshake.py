"""The authenticated handshake of a lane, in blocking I/O on the lane's own thread (L2.46).

The same sans-I/O machine as every connection (``protocol/handshake.py``), the same key
proofs and the same pre-authentication caps; only the driver differs: a thread reading
and writing one socket with a deadline, instead of the event loop. A lane never competes
with the peer's main connection, so its roster knows no ties: any member of the group
that proves the key may open lanes, up to the acceptor's limit.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncrpc.errors import AuthenticationError, ConnectionLostError, RemoteProtocolError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.handshake import Action, Adopt, Close, Handshake, Send, pre_auth_decoder
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import Refusal, decode_message
from asyncrpc.runtime.lanes.frames import BlockingFrames, lane_allocate

__all__ = ["HANDSHAKE_ERRORS", "LaneRoster", "Opened", "accept_lane", "dial_lane", "lane_target"]


class LaneRoster:
    """The acceptor's view of who may open a lane: a live member under its own name."""

    def __init__(self, name_of: Callable[[int], str | None], is_lost: Callable[[int], bool]):
        self._name_of = name_of
        self._is_lost = is_lost

    @classmethod
    def of(cls, addresses: dict[int, PeerAddress], is_lost: Callable[[int], bool]) -> LaneRoster:
        """The roster of a group's members (``addresses``: a live dict, a dynamic group
        adds to it)."""

        def name_of(rank: int) -> str | None:
            address = addresses.get(rank)
            return None if address is None else address.name

        return cls(name_of, is_lost)

    def refusal(self, name: str, rank: int) -> Refusal | None:
        if self._name_of(rank) != name:
            return Refusal.UNKNOWN_WORKER
        return Refusal.LOST if self._is_lost(rank) else None

    def connected(self, rank: int) -> bool:
        return False  # lanes are many per peer: none supersedes another


@dataclass(frozen=True, slots=True)
class Opened:
    """An authenticated lane: its frames, the peer, and the largest frame the peer takes."""

    frames: BlockingFrames
    rank: int
    name: str
    peer_max_frame: int


def lane_target(address: PeerAddress, host_id: str | None) -> str | tuple[str, int] | None:
    """Where the worker at ``address`` takes lanes: its Unix socket when it is on this host
    (``host_id``), else its TCP port; None when it takes none (``sync_lanes=0``, TLS)."""
    if address.lane_path and host_id and address.host_id == host_id:
        return address.lane_path
    if address.lane_port:
        return (address.host, address.lane_port)
    return None


def dial_lane(
    address: str | tuple[str, int],
    me: tuple[str, int],
    peer: tuple[str, int],
    key: bytes,
    max_frame_size: int,
    timeout: float,
) -> Opened:
    """Open a lane to ``peer`` at ``address`` (an abstract Unix path, or host and port).

    Raises:
        OSError: the address cannot be reached.
        AuthenticationError: the peer failed the key proof.
        ConnectionLostError: it refused the lane (over its limit, say) or closed it.
        TimeoutError: no handshake within ``timeout``.
    """
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    frames = BlockingFrames(sock, pre_auth_decoder(lane_allocate), max_frame_size)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        machine = Handshake.dialer(me, peer, key, max_frame_size, LaneRoster(_any, _never))
        opened = _drive(machine, frames, machine.start(), time.monotonic() + timeout)
    except BaseException:
        frames.close()
        raise
    return opened


def accept_lane(
    sock: socket.socket,
    me: tuple[str, int],
    key: bytes,
    max_frame_size: int,
    roster: LaneRoster,
    timeout: float,
) -> Opened:
    """Run the acceptor's side on an accepted socket; the socket is closed on failure.

    Raises:
        AuthenticationError: the dialer failed the key proof.
        RemoteProtocolError: it broke the protocol, or was refused (a stranger, say).
        ConnectionLostError: it went away.
        TimeoutError: no handshake within ``timeout``.
    """
    frames = BlockingFrames(sock, pre_auth_decoder(lane_allocate), max_frame_size)
    try:
        machine = Handshake.acceptor(me, key, max_frame_size, roster)
        opened = _drive(machine, frames, [], time.monotonic() + timeout)
    except BaseException:
        frames.close()
        raise
    return opened


def _drive(
    machine: Handshake, frames: BlockingFrames, actions: Sequence[Action], deadline: float
) -> Opened:
    """Perform the machine's actions and feed it what the peer sends, until it adopts."""
    for _ in range(4):  # Hello, HelloReply, Auth: three messages at most reach the machine
        for action in actions:
            if isinstance(action, Send):
                frames.write(encode_frame(action.message.to_fields(), b""), deadline)
            elif isinstance(action, Adopt):
                frames.open(action.name, action.max_frame_size)
                return Opened(frames, action.rank, action.name, action.max_frame_size)
            elif isinstance(action, Close):
                raise ConnectionLostError(f"the lane was refused: {action.reason or 'closed'}")
        frame = frames.read(deadline)
        actions = machine.receive(decode_message(frame.fields))
    raise RemoteProtocolError("the lane's handshake did not settle")


def _any(rank: int) -> str | None:
    del rank
    return None


def _never(rank: int) -> bool:
    del rank
    return False


# Errors a failed lane handshake may raise, for the callers that fall back to the loop.
HANDSHAKE_ERRORS = (OSError, AuthenticationError, RemoteProtocolError, ConnectionLostError)
