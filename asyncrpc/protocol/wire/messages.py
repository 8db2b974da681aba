"""Protocol messages carried in a frame's msgpack header (layer L1, sans-I/O).

Each message is a frozen dataclass named after what it carries; ``to_fields`` gives the
header array the frame codec writes and ``decode_message`` turns a received array back into
a message, rejecting anything malformed with ``RemoteProtocolError``. Payloads (pickles) and
tensor segments travel beside the header and are not interpreted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

from asyncrpc.errors import RemoteProtocolError

__all__ = [
    "ACK_WANTED",
    "CODED_REPLY",
    "Ack",
    "Auth",
    "BarrierOpened",
    "CallMode",
    "Cancel",
    "ErrorReply",
    "Goodbye",
    "Hello",
    "HelloReply",
    "Idle",
    "Kind",
    "Message",
    "Ping",
    "Pong",
    "RefMessage",
    "RefOp",
    "Refusal",
    "Reply",
    "Request",
    "ShmMessage",
    "ShmOp",
    "coded_request_fields",
    "decode_message",
    "optional_headers",
]


class Kind(IntEnum):
    """First element of every header array."""

    HELLO = 1
    HELLO_REPLY = 2
    REQUEST = 3
    REPLY = 4
    ERROR = 5
    CANCEL = 6
    REF = 7
    GOODBYE = 8
    AUTH = 9
    PING = 10
    PONG = 11
    SHM = 12
    # Streams (asyncrpc/protocol/wire/stream.py decodes these five).
    STREAM_ITEM = 13
    STREAM_CREDIT = 14
    STREAM_END = 15
    STREAM_ERROR = 16
    STREAM_CLOSE = 17
    # Lanes only (asyncrpc/runtime/lanes/): the caller read a reply carrying RRef forks.
    ACK = 18
    # Closing a connection both sides have left idle (asyncrpc/runtime/net/idle.py).
    IDLE = 19
    # A graceful shutdown's barrier is open (asyncrpc/runtime/group/shutdown.py).
    BARRIER_OPENED = 20
    # A stream item whose payload is a plain pickle of one int, float, str, bytes, bool or
    # None: read with pickle's own loads (asyncrpc/protocol/wire/stream.py).
    STREAM_VALUE = 21


class CallMode(IntEnum):
    """What the callee does with a request's result."""

    CALL = 0  # send the result back in a Reply
    REMOTE = 1  # keep the result as the value of a new owner RRef; no Reply
    STREAM = 2  # iterate the result: stream frames, no Reply (asyncrpc/protocol/wire/stream.py)
    # A call with a wire format of its own (protocol/coded.py): the target names it
    # among the callee's features' coded calls, the payload is its codec's. Lanes only.
    CODED = 3


class RefOp(IntEnum):
    """The reference-counting message a REF header carries (see asyncrpc/protocol/refcount.py)."""

    FORK_REQUEST = 1
    FORK_ACCEPTED = 2
    CHILD_ACCEPTED = 3
    USER_DELETE = 4
    FORK_QUERY = 5  # after a lost connection: did the frame carrying this fork arrive?
    FORK_UNKNOWN = 6  # the answer when it did not


class Refusal(IntEnum):
    """Why an acceptor refused a Hello (0: it did not). Decisions use the code; the
    reply's text is for people (see asyncrpc/protocol/handshake.py)."""

    NONE = 0  # accepted
    VERSION = 1  # the dialer speaks another protocol version
    UNKNOWN_WORKER = 2  # no worker of that name has that rank in this group
    LOST = 3  # the acceptor declared the dialer lost
    ALREADY_CONNECTED = 4  # the acceptor has not yet seen the old connection close
    TIE_BREAK = 5  # both dialled; the connection dialled by the lower rank is kept


class ShmOp(IntEnum):
    """What a SHM header says about shared memory (see asyncrpc/runtime/shm/shm.py)."""

    OFFER = 1  # values: the offerer's pid, and the fd, device and inode of its probe file
    ANSWER = 2  # values: [1] when the offer's file could be opened and matched, else [0]
    RELEASE = 3  # values: ids of chunks the receiver no longer uses (back to the arena)
    RETIRE = 4  # values: ids of chunks the sender closed (the receiver unmaps them)


@dataclass(frozen=True, slots=True)
class Hello:
    """Opens a connection: who is calling, which protocol they speak, and the dialer's
    fresh nonce for the authentication challenge (see ``asyncrpc/protocol/auth.py``).

    ``max_frame_size`` is the largest frame the dialer accepts (0: not said), so that the
    other side refuses an oversized message before sending it.
    """

    version: int
    name: str
    rank: int
    nonce: bytes = b""
    max_frame_size: int = 0

    def to_fields(self) -> list[Any]:
        return [Kind.HELLO, self.version, self.name, self.rank, self.nonce, self.max_frame_size]


@dataclass(frozen=True, slots=True)
class HelloReply:
    """Answers a Hello: ``refusal`` is ``Refusal.NONE`` when it is accepted, else why not
    (``reason`` says it in words, for logs and errors only).

    An accepting reply carries the acceptor's nonce and its proof of the key, and the
    largest frame the acceptor accepts (0: not said).
    """

    version: int
    name: str
    rank: int
    refusal: Refusal
    reason: str = ""
    nonce: bytes = b""
    proof: bytes = b""
    max_frame_size: int = 0

    @property
    def accepted(self) -> bool:
        return self.refusal == Refusal.NONE

    def to_fields(self) -> list[Any]:
        return [
            Kind.HELLO_REPLY,
            self.version,
            self.name,
            self.rank,
            int(self.refusal),
            self.reason,
            self.nonce,
            self.proof,
            self.max_frame_size,
        ]


@dataclass(frozen=True, slots=True)
class Auth:
    """The dialer's proof of the key, answering an accepting HelloReply."""

    proof: bytes

    def to_fields(self) -> list[Any]:
        return [Kind.AUTH, self.proof]


@dataclass(frozen=True, slots=True)
class Request:
    """Run the pickled ``(function, args, kwargs)`` payload.

    ``timeout`` is the caller's limit in seconds (0: none): the callee gives up on the value
    of a ``remote()`` request that outlives it (the caller's RRef is unusable by then); a
    call the caller gave up on is cancelled by its ``Cancel``.
    ``target`` names the function for errors and metrics. For ``CallMode.REMOTE`` the
    ``rref_id`` and ``fork_id`` pairs name the owner RRef to create and the caller's fork.
    ``headers`` holds the call pipeline's fields (hook key -> msgpack value); it is left
    off the wire entirely when no hook added one.
    """

    call_id: int
    timeout: float
    mode: int
    target: str
    rref_id: tuple[int, int] | None = None
    fork_id: tuple[int, int] | None = None
    headers: dict[str, Any] | None = None

    def to_fields(self) -> list[Any]:
        fields = [
            Kind.REQUEST,
            self.call_id,
            self.timeout,
            self.mode,
            self.target,
            self.rref_id,
            self.fork_id,
        ]
        if self.headers:
            fields.append(self.headers)
        return fields


def coded_request_fields(call_id: int, timeout: float, target: str) -> list[Any]:
    """The fields of ``Request(call_id, timeout, CallMode.CODED, target)``, built without
    the object (a frozen dataclass costs ~0.8 µs to make, on a coded call's hot path)."""
    return [Kind.REQUEST, call_id, timeout, CallMode.CODED, target, None, None]


@dataclass(frozen=True, slots=True)
class Reply:
    """The pickled result of request ``call_id``, with the pipeline's reply fields if any."""

    call_id: int
    headers: dict[str, Any] | None = None

    def to_fields(self) -> list[Any]:
        if self.headers:
            return [Kind.REPLY, self.call_id, self.headers]
        return [Kind.REPLY, self.call_id]


# The reply header field a lane's server sets when the reply carries RRef forks: the
# caller answers with an ``Ack`` once it has unpickled the reply, which proves the forks
# arrived (asyncrpc/runtime/lanes/). Hooks' own fields never use this key.
ACK_WANTED: Final = "ack"
# The reply header field of a ``CallMode.CODED`` request's reply coded by its call's own
# codec (absent: the reply is pickled, as any). Hooks' own fields never use this key.
CODED_REPLY: Final = "cd"


@dataclass(frozen=True, slots=True)
class Ack:
    """On a lane: the caller has read reply ``call_id`` and the RRef forks it carried."""

    call_id: int

    def to_fields(self) -> list[Any]:
        return [Kind.ACK, self.call_id]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Request ``call_id`` raised; the payload is a packed exception."""

    call_id: int
    headers: dict[str, Any] | None = None

    def to_fields(self) -> list[Any]:
        if self.headers:
            return [Kind.ERROR, self.call_id, self.headers]
        return [Kind.ERROR, self.call_id]


@dataclass(frozen=True, slots=True)
class Cancel:
    """The caller gave up on request ``call_id`` (timeout or cancellation)."""

    call_id: int

    def to_fields(self) -> list[Any]:
        return [Kind.CANCEL, self.call_id]


@dataclass(frozen=True, slots=True)
class RefMessage:
    """One reference-counting message about ``fork_id`` of ``rref_id``."""

    op: int
    rref_id: tuple[int, int]
    fork_id: tuple[int, int]

    def to_fields(self) -> list[Any]:
        return [Kind.REF, self.op, list(self.rref_id), list(self.fork_id)]


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The sender is closing this connection on purpose (graceful shutdown)."""

    reason: str = ""

    def to_fields(self) -> list[Any]:
        return [Kind.GOODBYE, self.reason]


@dataclass(frozen=True, slots=True)
class BarrierOpened:
    """Every worker reached the shutdown barrier ``tag``: passed down a tree of workers
    rooted at ``root``. ``dead``: some rank was counted dead there (read who)."""

    tag: str
    root: int
    dead: bool = False

    def to_fields(self) -> list[Any]:
        return [Kind.BARRIER_OPENED, self.tag, self.root, self.dead]


@dataclass(frozen=True, slots=True)
class Ping:
    """Are you alive? (sent on an idle connection; answered with a Pong at once)."""

    def to_fields(self) -> list[Any]:
        return [Kind.PING]


@dataclass(frozen=True, slots=True)
class Pong:
    """Alive."""

    def to_fields(self) -> list[Any]:
        return [Kind.PONG]


@dataclass(frozen=True, slots=True)
class ShmMessage:
    """Shared-memory bookkeeping between two workers on one host: an op and its integers."""

    op: int
    values: tuple[int, ...]

    def to_fields(self) -> list[Any]:
        return [Kind.SHM, int(self.op), list(self.values)]


@dataclass(frozen=True, slots=True)
class Idle:
    """About closing an idle connection: ``ask`` True, "I have nothing in flight with you,
    and have written my last frame on this connection: close it if you have nothing
    either"; False, "I have: keep it" (the asker takes it back)."""

    ask: bool

    def to_fields(self) -> list[Any]:
        return [Kind.IDLE, self.ask]


Message = (
    Hello
    | HelloReply
    | Auth
    | Request
    | Reply
    | ErrorReply
    | Cancel
    | RefMessage
    | Goodbye
    | Ping
    | Pong
    | ShmMessage
    | Ack
    | Idle
    | BarrierOpened
)


def decode_message(fields: list[Any]) -> Message:
    """Build the message a received header array describes.

    Args:
        fields: the header array without its segment list.

    Returns:
        The message.

    Raises:
        RemoteProtocolError: the array does not describe a valid message.
    """
    try:
        kind = fields[0]
        decoder = _DECODERS[kind]
    except (IndexError, KeyError, TypeError):
        raise RemoteProtocolError(f"unknown message header {fields[:1]!r}") from None
    try:
        message: Message = decoder(fields)
    except (IndexError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {Kind(kind).name} header: {fields!r}") from exc
    return message


def _int(value: Any) -> int:
    # bool is an int subclass; a peer sending True for an id is broken.
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a bool, got {value!r}")
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a str, got {value!r}")
    return value


def _pair(value: Any) -> tuple[int, int]:
    first, second = value
    return (_int(first), _int(second))


def _optional_pair(value: Any) -> tuple[int, int] | None:
    return None if value is None else _pair(value)


def _bytes(value: Any, limit: int = 64) -> bytes:
    if type(value) is not bytes or len(value) > limit:
        raise TypeError(f"expected at most {limit} bytes, got {value!r:.80}")
    return value


def _decode_hello(f: list[Any]) -> Hello:
    return Hello(_int(f[1]), _str(f[2]), _int(f[3]), _bytes(f[4]), _frame_limit(f, 5))


def _decode_hello_reply(f: list[Any]) -> HelloReply:
    return HelloReply(
        _int(f[1]), _str(f[2]), _int(f[3]), Refusal(_int(f[4])), _str(f[5]), _bytes(f[6]),
        _bytes(f[7]), _frame_limit(f, 8),
    )  # fmt: skip


def _frame_limit(f: list[Any], index: int) -> int:
    # Optional (0 when absent): a peer that does not say its limit is not checked against.
    limit = _int(f[index]) if len(f) > index else 0
    if limit < 0:
        raise ValueError(f"negative frame limit {limit}")
    return limit


def _decode_request(f: list[Any]) -> Request:
    timeout = f[2]
    if type(timeout) not in (int, float) or not 0 <= timeout < math.inf:  # NaN fails too
        raise ValueError(f"bad timeout {timeout!r}")
    mode = _int(f[3])
    if mode not in _CALL_MODES:  # a set lookup: CallMode(mode) costs ~0.6 µs per request
        raise ValueError(f"unknown call mode {mode!r}")
    return Request(
        _int(f[1]),
        float(timeout),
        mode,
        _str(f[4]),
        _optional_pair(f[5]),
        _optional_pair(f[6]),
        optional_headers(f, 7),
    )


def optional_headers(fields: list[Any], index: int) -> dict[str, Any] | None:
    """The pipeline's header fields at ``index``: absent, or a map keyed by strings.

    Raises:
        TypeError: present but not such a map (the caller turns it into a protocol error).
    """
    if len(fields) <= index:
        return None
    headers = fields[index]
    if type(headers) is not dict or not all(type(k) is str for k in headers):
        raise TypeError(f"expected a map of header fields, got {headers!r}")
    return headers


def _decode_ref(f: list[Any]) -> RefMessage:
    op = _int(f[1])
    if op not in _REF_OPS:
        raise ValueError(f"unknown reference operation {op!r}")
    return RefMessage(op, _pair(f[2]), _pair(f[3]))


def _decode_shm(f: list[Any]) -> ShmMessage:
    op = _int(f[1])
    if op not in _SHM_OPS:
        raise ValueError(f"unknown shared-memory operation {op!r}")
    values = f[2]
    if type(values) is not list:
        raise TypeError(f"expected a list of integers, got {values!r:.80}")
    return ShmMessage(op, tuple(_int(v) for v in values))


_CALL_MODES = frozenset(int(mode) for mode in CallMode)
_REF_OPS = frozenset(int(op) for op in RefOp)
_SHM_OPS = frozenset(int(op) for op in ShmOp)


_DECODERS: dict[int, Any] = {
    Kind.HELLO: _decode_hello,
    Kind.HELLO_REPLY: _decode_hello_reply,
    Kind.REQUEST: _decode_request,
    Kind.REPLY: lambda f: Reply(_int(f[1]), optional_headers(f, 2)),
    Kind.ERROR: lambda f: ErrorReply(_int(f[1]), optional_headers(f, 2)),
    Kind.CANCEL: lambda f: Cancel(_int(f[1])),
    Kind.REF: _decode_ref,
    Kind.GOODBYE: lambda f: Goodbye(_str(f[1])),
    Kind.AUTH: lambda f: Auth(_bytes(f[1])),
    Kind.PING: lambda f: Ping(),
    Kind.PONG: lambda f: Pong(),
    Kind.SHM: _decode_shm,
    Kind.ACK: lambda f: Ack(_int(f[1])),
    Kind.IDLE: lambda f: Idle(_bool(f[1])),
    Kind.BARRIER_OPENED: lambda f: BarrierOpened(_str(f[1]), _int(f[2]), _bool(f[3])),
}
