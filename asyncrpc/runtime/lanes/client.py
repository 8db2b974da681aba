"""The caller's side of lanes: a calling thread's own connection to a peer, for its
synchronous calls (layer L2.46).

``rpc_sync`` from a user thread used to hand its request to the event loop and sleep
until the loop handed the reply back: two thread wake-ups on the caller, on top of the
callee's. A lane is a connection owned by one calling thread and one peer: the thread
writes its request and blocks in ``recv`` for the reply itself (the GIL released), so no
other thread takes part on this side. A thread opens a lane to a peer at its second
synchronous call to it (a thread that calls once pays no handshake), at most
``LANES_PER_PEER`` per peer; past that, or when the peer takes no lanes, calls take the
loop's path as before.

Only plain calls take a lane: no pipeline hook active on the call but lane-safe ones
(a distributed autograd context is; a profiler or a device map is not), no RRef fork in
its payload, a frame small enough for the loop's path not to use shared memory, and a
plain function (an ``async def`` or ``async_execution`` function runs on the callee's
loop: its loop's path costs that side nothing). The hooks that saw the call are told how
it ended on this thread, as the loop tells them for its own calls. What travels is the
wire's own frames and the same handshake.

A timed-out call leaves its lane usable: a late reply is recognised by its call id and
dropped. A lane breaks when its socket does, or when the agent closes it (the peer is
declared lost, or this worker shuts down); the call fails as it would on the loop's path.
With ``idle_timeout`` set, a lane no call used for that long is closed (``close_idle``),
with the peer's thread serving it; its thread's next call to that peer dials a new one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from asyncrpc.errors import (
    ClosedError,
    ConnectionLostError,
    PeerLostError,
    RemoteProtocolError,
    RpcTimeoutError,
)
from asyncrpc.errorstate import own_copy
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.wire import encode_frame
from asyncrpc.protocol.wire.messages import (
    ACK_WANTED,
    CODED_REPLY,
    Ack,
    Cancel,
    Kind,
    optional_headers,
)
from asyncrpc.runtime.calls.outbox import EncodedRequest, Observed
from asyncrpc.runtime.calls.pipeline import Pipeline
from asyncrpc.runtime.lanes.frames import FIGURES, BlockingFrames, Unsent, figures, retire
from asyncrpc.runtime.lanes.handshake import HANDSHAKE_ERRORS, dial_lane, lane_target
from asyncrpc.runtime.net.peers import closed_by_peer, without_goodbye
from asyncrpc.runtime.threads.blocking import blocking

__all__ = ["LANES_PER_PEER", "UNSENT", "CallerLanes", "Lane", "LaneCall"]

_log = logging.getLogger(__name__)

# What ``CallerLanes.call`` returns for a request that never left: it may go another way.
UNSENT: Final = object()
# Lanes to one peer from this process at most (one per calling thread).
LANES_PER_PEER = 16
# A peer whose lane could not be opened is not dialled again for this long.
_RETRY_AFTER_S = 30.0


class Lane:
    """One calling thread's connection to one peer."""

    __slots__ = (
        "__weakref__", "acked", "busy", "frames", "lost", "name", "rank", "remotes", "replied",
        "used",
    )  # fmt: skip

    def __init__(
        self, frames: BlockingFrames, rank: int, name: str,
        acked: Callable[[int, list[Any]], None] | None = None,
    ) -> None:  # fmt: skip
        self.frames, self.rank, self.name = frames, rank, name
        # ``acked(rank, forks)``: the owner registered the forks of a remote() request sent
        # on this lane (its Ack was read), as its ForkAccepted will also say.
        self.acked = acked
        self.replied = 0  # the size of the last reply frame ``call`` read (for the hooks)
        self.lost: PeerLostError | None = None  # why the agent closed it, if it did
        # In a call (set and cleared under CallerLanes' lock), and when the last one ended:
        # an idle lane is closed only between calls (``CallerLanes.close_idle``).
        self.busy = False
        self.used = time.monotonic()
        # remote() requests sent on it whose Ack has not been read yet: call id -> the
        # RRef forks they carry (in doubt if the lane dies first; the owner is asked).
        self.remotes: dict[int, list[Any]] = {}

    def call(
        self, call_id: int, pieces: list[Any], timeout: float, loads: Callable[..., Any],
        policy: TensorPolicy | None = None,
        coded: Callable[[Any, Sequence[object]], Any] | None = None,
    ) -> tuple[Any, BaseException | None, dict[str, Any] | None]:  # fmt: skip
        """Write a request and read its reply on this lane (blocking this thread);
        ``coded`` decodes a reply its callee coded (``CODED_REPLY``), ``loads`` any other.

        Returns:
            ``(value, None, headers)``, or ``(None, the remote exception, headers)`` with
            the exception as its original type: raised by the caller, so that it is never
            taken for the lane's own failure. ``headers`` are the reply's header fields.

        Raises:
            TimeoutError: ``timeout`` (seconds, 0: none) passed before the reply.
            ClosedError, ConnectionLostError, RemoteProtocolError: the lane broke.
            SerializationError: the reply cannot be unpickled here (the lane is fine).
        """
        deadline = None if timeout == 0 else time.monotonic() + timeout
        self.frames.write(pieces, deadline)
        return self.reply(call_id, deadline, loads, policy, coded)

    def reply(
        self, call_id: int, deadline: float | None, loads: Callable[..., Any],
        policy: TensorPolicy | None = None,
        coded: Callable[[Any, Sequence[object]], Any] | None = None,
    ) -> tuple[Any, BaseException | None, dict[str, Any] | None]:  # fmt: skip
        """Read the reply of request ``call_id``, written on this lane (``call``).

        Returns and raises as ``call``.
        """
        frames = self.frames
        while True:  # bounded by the deadline: late replies of earlier calls are dropped
            frame = frames.read(deadline)
            fields = frame.fields
            kind = fields[0]
            if kind == Kind.ACK:  # the owner read a remote() request sent on this lane
                forks = self.remotes.pop(fields[1], None)
                if forks and self.acked is not None:
                    self.acked(self.rank, forks)
                continue
            if kind not in (Kind.REPLY, Kind.ERROR):
                raise RemoteProtocolError(f"unexpected frame of kind {kind!r} on a lane")
            if fields[1] != call_id:
                continue  # the reply of a call that timed out
            headers = optional_headers(fields, 2)
            self.replied = frame.nbytes
            if kind == Kind.ERROR:
                return None, unpack_exception(bytes(frame.payload)), headers
            if coded is not None and headers is not None and CODED_REPLY in headers:
                return coded(frame.payload, frame.segments), None, headers
            value = loads(frame.payload, frame.segments, context=self.rank, policy=policy)
            if headers is not None and ACK_WANTED in headers:
                # The reply's RRef forks are unpickled: its owner may stop following them.
                # If the Ack cannot go, the lane is broken: the owner asks about them.
                try:
                    frames.write(encode_frame(Ack(call_id).to_fields(), b""), deadline)
                except (Unsent, OSError, ClosedError, ConnectionLostError):
                    frames.close()
            return value, None, headers

    def cancel(self, call_id: int) -> None:
        """Tell the callee the call is over (it will not run it if it has not yet)."""
        try:
            self.frames.write(
                encode_frame(Cancel(call_id).to_fields(), b""), time.monotonic() + 1.0
            )
        except (Unsent, OSError, ClosedError, ConnectionLostError):
            self.frames.close()


class LaneCall:
    """A call whose request ``CallerLanes.start`` wrote, its reply still to read."""

    __slots__ = ("deadline", "encoded", "error", "lane", "outcome")

    def __init__(self, lane: Lane, encoded: EncodedRequest, deadline: float | None) -> None:
        self.lane, self.encoded, self.deadline = lane, encoded, deadline
        # Where the write failed after a part of the request left: how it counts, its error.
        self.outcome = "calls_failed"
        self.error: BaseException | None = None


# What a lane's failure raises (see CallerLanes._failure for what each means for a call).
_LANE_ERRORS = (
    Unsent, TimeoutError, ClosedError, ConnectionLostError, RemoteProtocolError, OSError
)  # fmt: skip


class _ThreadLanes:
    """What one calling thread holds: its lanes by peer, and its calls before it opens one.

    Its death (with its thread's locals) closes its lanes, through a finalizer.
    """

    __slots__ = ("__weakref__", "calls", "lanes")

    def __init__(self) -> None:
        self.lanes: dict[int, Lane] = {}
        self.calls: dict[int, int] = {}


class CallerLanes:
    """The lanes this worker's calling threads hold, one per thread and peer.

    Args:
        me: this worker's name and rank.
        addresses: the group's addresses by rank (a live dict: a dynamic group adds to it).
        host_id: this host's identity, for Unix sockets (None: this worker uses none).
        key: the group key, for the handshake.
        max_frame_size: the largest frame this worker takes.
        timeout: bound on a lane's handshake, in seconds.
        serializer: unpickles replies (its RRef hooks; no shared memory on a lane).
        small: the frame size below which the loop's path would not use shared memory.
        enabled: whether this worker opens lanes at all.
        in_doubt: ``in_doubt(rank, forks)`` asks ``rank`` about forks written on a lane
            that died before their Ack (any thread; the RRef layer's ForkQuery).
        busy_poll: seconds a calling thread polls its lane for the reply before it sleeps
            (the ``busy_poll_us`` option; 0: never).
        acked: ``acked(rank, forks)``, told (on the calling thread) that ``rank`` Acked a
            remote() request carrying ``forks``: it registered them (the RRef layer).
    """

    def __init__(
        self, me: tuple[str, int], addresses: dict[int, PeerAddress], host_id: str | None,
        key: bytes, max_frame_size: int, timeout: float, serializer: Serializer, small: int,
        enabled: bool, in_doubt: Callable[[int, list[Any]], None], busy_poll: float = 0.0,
        acked: Callable[[int, list[Any]], None] | None = None,
    ) -> None:  # fmt: skip
        self._me, self._addresses, self._host_id = me, addresses, host_id
        self._acked = acked
        self._busy_poll = busy_poll
        self._key, self._max_frame_size, self._timeout = key, max_frame_size, timeout
        self._in_doubt = in_doubt
        self._loads = serializer.loads
        self._small = small
        self._enabled = enabled
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lanes: set[Lane] = set()  # every open lane, for the agent to close
        self._refused: dict[int, float] = {}  # rank -> when a lane may be dialled again
        self._lost: dict[int, PeerLostError] = {}
        self.UNSENT = UNSENT  # what call() returns for a request that never left
        self.closed = False
        self.in_flight = 0
        self.opened = 0
        # Counted like the loop's calls (get_metrics adds them up), under the lock; the
        # bytes of lanes already closed are kept in ``_retired``.
        self.counts = {"calls_sent": 0, "calls_failed": 0, "calls_timed_out": 0}
        self._retired = dict.fromkeys(FIGURES, 0)

    def lane(self, rank: int, nbytes: int) -> Lane | None:
        """This thread's lane to ``rank`` for a plain call of ``nbytes`` bytes, opened if
        this is its second call there; None: use the loop's path."""
        if not self._enabled or nbytes >= self._small or rank == self._me[1]:
            return None
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _ThreadLanes()
            # The finalizer holds the dict of its lanes, not the object (it would never die).
            weakref.finalize(held, self._remove, held.lanes.values())
        lane = held.lanes.get(rank)
        if lane is not None:
            if not lane.frames.closed:
                return lane
            del held.lanes[rank]
        calls = held.calls[rank] = held.calls.get(rank, 0) + 1
        if calls < 2:
            return None
        lane = self._open(rank)
        if lane is not None:
            held.lanes[rank] = lane
        return lane

    def _open(self, rank: int) -> Lane | None:
        address = self._addresses.get(rank)
        target = None if address is None else self._target(address)
        if target is None or self.closed or rank in self._lost:
            return None
        with self._lock:
            if time.monotonic() < self._refused.get(rank, 0.0):
                return None
            if sum(1 for lane in self._lanes if lane.rank == rank) >= LANES_PER_PEER:
                return None
        assert address is not None
        try:
            opened = dial_lane(
                target, self._me, (address.name, rank), self._key, self._max_frame_size,
                self._timeout,
            )  # fmt: skip
        except HANDSHAKE_ERRORS as exc:
            _log.debug("no lane to %r (the loop's path instead): %s", address.name, exc)
            with self._lock:
                self._refused[rank] = time.monotonic() + _RETRY_AFTER_S
            return None
        opened.frames.spin = self._busy_poll
        lane = Lane(opened.frames, rank, address.name, self._acked)
        with self._lock:
            if self.closed or rank in self._lost:
                lane.frames.close()
                return None
            self._lanes.add(lane)
            self.opened += 1
        return lane

    def _target(self, address: PeerAddress) -> str | tuple[str, int] | None:
        return lane_target(address, self._host_id)

    def call(self, lane: Lane, encoded: EncodedRequest) -> Any:
        """Run one call on ``lane`` (see ``Lane.call``), its errors as the loop's path
        gives them (``RpcTimeoutError``, ``PeerLostError`` or ``ClosedError``), and the
        hooks that saw it told how it ended, as the loop's pending calls tell them.

        Returns:
            The call's value, or ``UNSENT`` when the lane broke before one byte of the
            request was written: the call did not happen, and may go another way.
        """
        started = self.start(lane, encoded)
        return UNSENT if started is None else self.finish(started)

    def start(self, lane: Lane, encoded: EncodedRequest) -> LaneCall | None:
        """The first half of ``call``: write the request; ``finish`` reads its reply, after
        other work (several calls in flight on this thread's lanes at once). None where
        not one byte of it left (it may go another way)."""
        with self._lock:
            if lane.frames.closed:
                return None  # closed for idleness since this thread took it: go another way
            lane.busy = True
            self.in_flight += 1
        lane.replied = 0
        timeout = encoded.timeout
        started = LaneCall(lane, encoded, None if timeout == 0 else time.monotonic() + timeout)
        try:
            with blocking():  # see finish
                lane.frames.write(encoded.pieces, started.deadline)
        except _LANE_ERRORS as exc:
            started.outcome, started.error = self._failure(lane, encoded, exc)
            if started.error is None:
                self._end(lane, "")
                return None
        except BaseException as exc:  # interrupted mid-call (KeyboardInterrupt...): start afresh
            lane.frames.close()
            self._end(lane, "calls_failed")
            _tell_hooks(encoded.observed, None, None, exc)
            raise
        return started

    def finish(self, started: LaneCall) -> Any:
        """The second half of ``call``: the reply of the request ``start`` wrote (its
        value, or its error raised)."""
        lane, encoded = started.lane, started.encoded
        observed = encoded.observed
        policy = None if observed is None else observed[1].reply_policy
        outcome, error, value, headers = started.outcome, started.error, None, None
        try:
            if error is None:
                # A pool thread waiting here holds a pool thread: its pool may start a
                # stand-in, so nested synchronous calls deeper than the pool never deadlock.
                with blocking():
                    value, error, headers = lane.reply(
                        encoded.call_id, started.deadline, self._loads, policy, encoded.coded
                    )
                outcome = "calls_sent" if error is None else "calls_failed"
        except _LANE_ERRORS as exc:
            outcome, error = self._failure(lane, encoded, exc)
            if error is None:  # a read never says "unsent"; keep the contract anyway
                error = PeerLostError(lane.name, f"its lane broke: {exc}")
        except BaseException as exc:  # interrupted mid-call (KeyboardInterrupt...): start afresh
            lane.frames.close()
            _tell_hooks(observed, None, None, exc)
            raise
        finally:
            self._end(lane, outcome)
        if observed is not None:
            observed[1].reply_nbytes = lane.replied
        _tell_hooks(observed, value, headers, error)
        if error is None:
            return value
        try:
            raise error
        finally:
            # The frames a raised error carries must not hold it (a cycle that would keep
            # the RRefs in those frames alive until a garbage collection).
            error = None

    def _end(self, lane: Lane, outcome: str) -> None:
        self._count(outcome, lane)
        if lane.frames.closed:
            self._remove([lane])

    def send(self, lane: Lane, encoded: EncodedRequest) -> bool:
        """Write a request that expects no reply (remote()) on ``lane``, its forks followed
        until the owner's Ack; False if not one byte of it left (it may go another way)."""
        forks = encoded.forks or []
        with self._lock:
            if lane.frames.closed:
                return False  # closed for idleness since this thread took it
            lane.busy = True
        lane.remotes[encoded.call_id] = forks
        try:
            lane.frames.write(encoded.pieces, time.monotonic() + self._timeout)
        except Unsent:
            del lane.remotes[encoded.call_id]
            self._remove([lane])
            return False
        except (TimeoutError, ClosedError, ConnectionLostError, OSError):
            self._remove([lane])  # cut short: it may have arrived (its forks in doubt)
            return True
        finally:
            with self._lock:
                lane.busy, lane.used = False, time.monotonic()
        with self._lock:
            self.counts["calls_sent"] += 1
        return True

    def _failure(
        self, lane: Lane, encoded: EncodedRequest, exc: BaseException
    ) -> tuple[str, BaseException | None]:
        """What a lane's failure means for its call: the counter it goes in, and the error
        its caller gets (None: the request never left, it may go another way)."""
        call_id, target, timeout = encoded.call_id, encoded.target, encoded.timeout
        if isinstance(exc, Unsent) and not isinstance(exc.reason, TimeoutError):
            lane.frames.close()
            return "", None
        if isinstance(exc, (Unsent, TimeoutError)):
            if isinstance(exc, Unsent) or not lane.frames.decoder.at_frame_boundary():
                lane.frames.close()
            else:
                lane.cancel(call_id)  # a reply cut short is finished by the next read
            return "calls_timed_out", RpcTimeoutError(lane.name, target, timeout)
        lane.frames.close()
        if lane.lost is not None:
            return "calls_failed", own_copy(lane.lost)
        if self.closed:
            return "calls_failed", ClosedError(
                f"worker {self._me[0]!r} shut down before the reply came"
            )
        reason = f"its lane broke: {exc}"
        if isinstance(exc, ConnectionLostError) and closed_by_peer(exc.__cause__):
            reason = without_goodbye(reason)  # the peer closed it: as on the loop's path
        return "calls_failed", PeerLostError(lane.name, reason)

    def _count(self, outcome: str, lane: Lane) -> None:
        """One call on ``lane`` is over: count it as sent (every call that left), and how
        it failed, if it did."""
        with self._lock:
            lane.busy, lane.used = False, time.monotonic()
            self.in_flight -= 1
            if not outcome:
                return  # never left
            self.counts["calls_sent"] += 1
            if outcome != "calls_sent":
                self.counts[outcome] += 1

    def _remove(self, lanes: Iterable[Lane], lost: PeerLostError | None = None) -> None:
        """Close ``lanes`` and forget them (their bytes stay counted); a blocked caller
        gets ``lost``, if given (its peer is gone), or the lane's own error."""
        lanes = list(lanes)
        with self._lock:
            for lane in lanes:
                if lane in self._lanes:
                    self._lanes.discard(lane)
                    retire(lane.frames, self._retired)
        for lane in lanes:
            if lost is not None:
                lane.lost = lost
            lane.frames.close()
            remotes, lane.remotes = lane.remotes, {}
            in_doubt = [fork for forks in remotes.values() for fork in forks]
            if in_doubt and lost is None:  # a lost owner's forks are dropped with it
                self._in_doubt(lane.rank, in_doubt)

    def close_idle(self, seconds: float) -> int:
        """Close the lanes no call has used for ``seconds`` (``idle_timeout``); how many.

        Closed under the lock that a call takes to start, so none is closed under a call:
        a thread that took such a lane just before finds it closed and goes another way
        (its request never left). The peer's thread serving it ends at the close. A
        remote() request's Ack not read yet (it is read by the lane's next call) puts its
        forks in doubt: their owner is asked, as when a lane breaks.
        """
        now = time.monotonic()
        with self._lock:
            idle = [lane for lane in self._lanes if not lane.busy and now - lane.used >= seconds]
            for lane in idle:
                lane.frames.close()
        self._remove(idle)
        return len(idle)

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good: close its lanes (a blocked caller gets ``error``)."""
        with self._lock:
            self._lost[rank] = error
            lanes = [lane for lane in self._lanes if lane.rank == rank]
        self._remove(lanes, error)

    def close(self) -> None:
        """This worker shuts down: close every lane (blocked callers get ``ClosedError``)."""
        with self._lock:
            self.closed = True
            lanes = list(self._lanes)
        self._remove(lanes)

    def stats(self) -> dict[str, int]:
        """The lanes' own figures (``lanes_*``), and their share of the agent's counters."""
        with self._lock:
            lanes = list(self._lanes)
            summed = figures([lane.frames for lane in lanes], self._retired)
            return {
                "lanes_open": len(lanes), "lanes_opened": self.opened,
                "lane_calls": self.counts["calls_sent"], **self.counts,
                "bytes_in": summed["bytes_in"], "bytes_out": summed["bytes_out"],
                "lane_polls": summed["polls"], "lane_poll_hits": summed["poll_hits"],
            }  # fmt: skip


def _tell_hooks(
    observed: Observed | None, value: Any, headers: dict[str, Any] | None,
    error: BaseException | None,
) -> None:  # fmt: skip
    """Tell the hooks that saw a call how it ended (lane-safe hooks, on this thread)."""
    if observed is not None:
        hooks, call = observed
        call.result = value
        Pipeline.completed(hooks, call, headers, error)
        if error is None and call.on_value is not None:
            call.on_value()  # e.g. this thread's CUDA streams wait for the reply
