"""The callee's side of lanes: a thread per lane runs the synchronous calls it carries
(layer L2.46).

A lane is one blocking connection a peer's calling thread opened for its ``rpc_sync``
calls (see ``client.py``). Its thread here reads a request, runs a plain function right
there and writes the reply: no hand-off to the event loop or to the pool, so a ``def``
call costs one thread wake-up on each side, where the loop's path costs three. What
belongs to the loop still goes there: a request some hook serves that is not lane-safe
(the profiler, a device map), an ``async def``, ``async_execution`` or ``@inline``
function. A lane-safe hook (distributed autograd) runs its stages here. The
lane's thread hands it to the dispatcher with a ``LaneReply`` as its connection and
writes the reply the dispatcher builds.

A reply that carries RRef forks asks the caller for an ``Ack``: until it comes, the forks
are followed; a lane that dies first leaves them in doubt, and the owner asks the peer
about them, as for a connection that dies (``protocol/reflog.py``).

One thread accepts on both listening sockets (TCP, and an abstract Unix socket for peers
on this host); each accepted socket gets a thread, which runs the handshake under the
handshake deadline and then serves. At most ``limit`` lanes are open at once; past it a
dial is closed at once, and the peer's caller uses the loop's path.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from asyncrpc.errors import (
    ClosedError,
    FrameTooLargeError,
    RemoteProtocolError,
    SerializationError,
)
from asyncrpc.functions import is_async_execution, is_coroutine_function, is_inline
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.serde import MissingReferenceError, pack_exception
from asyncrpc.protocol.wire import Frame, body_nbytes, encode_frame
from asyncrpc.protocol.wire.messages import (
    ACK_WANTED,
    CODED_REPLY,
    Ack,
    CallMode,
    ErrorReply,
    Reply,
    Request,
    decode_message,
)
from asyncrpc.runtime.calls.builtins import checked_op, is_torch_c_function
from asyncrpc.runtime.calls.deadline import deadline_after, running_until
from asyncrpc.runtime.calls.pipeline import IncomingCall
from asyncrpc.runtime.calls.served import missing_reference_error, print_request_error
from asyncrpc.runtime.lanes.frames import FIGURES, BlockingFrames, Unsent, figures, retire
from asyncrpc.runtime.lanes.handshake import HANDSHAKE_ERRORS, accept_lane
from asyncrpc.runtime.lanes.serving import LaneReply, Serving

__all__ = ["LaneServer"]

_log = logging.getLogger(__name__)

_CODED_HEADERS: Final = {CODED_REPLY: 1}  # a coded reply's mark (never written to)


class _Lane:
    """One lane this worker serves: its frames and thread, and what waits on its caller."""

    __slots__ = ("frames", "name", "pending", "rank", "unacked")

    def __init__(self, frames: BlockingFrames, rank: int, name: str) -> None:
        self.frames, self.rank, self.name = frames, rank, name
        self.pending: LaneReply | None = None  # a request handed to the loop
        self.unacked: dict[int, Any] = {}  # call id -> RRef forks its reply carried


class LaneServer:
    """The lanes this worker serves (``limit``: how many may be open at once)."""

    def __init__(self, sockets: list[socket.socket], limit: int) -> None:
        self._listening = sockets
        self._limit = limit
        self._lock = threading.Lock()
        self._lanes: set[_Lane] = set()
        self._open = 0  # lanes accepted and not closed yet, handshaking ones included
        self._serving: Serving | None = None
        self._joined = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self.running = 0  # requests running on lane threads now
        # Counted like the loop's (get_metrics adds them up), under the lock; the bytes of
        # lanes already closed are kept in ``_retired``.
        self.counts = {
            "calls_received": 0, "replies_sent": 0, "errors_sent": 0, "coded_calls_received": 0
        }  # fmt: skip
        self._retired = dict.fromkeys(FIGURES, 0)
        self.port: int | None = None
        self.path: str | None = None
        for sock in sockets:
            if sock.family == socket.AF_UNIX:  # abstract: its name comes back as bytes
                self.path = os.fsdecode(sock.getsockname())
            else:
                self.port = sock.getsockname()[1]
        # Nothing to accept on (this worker takes no lanes): no thread either.
        self._acceptor: threading.Thread | None = None
        if sockets:
            self._acceptor = threading.Thread(
                target=self._accept, name="asyncrpc-lanes", daemon=True
            )
            self._acceptor.start()

    @classmethod
    def listen(cls, host: str, unix: bool, limit: int) -> LaneServer:
        """Listen on ``host`` (a free port) and, when ``unix``, an abstract Unix socket;
        with ``limit`` 0, on nothing (this worker takes no lanes: its ``port`` and ``path``
        are None, and peers call it the loop's way).

        Raises:
            OSError: the address cannot be bound.
        """
        if limit <= 0:
            return cls([], 0)
        sockets: list[socket.socket] = []
        try:
            tcp = socket.create_server((host, 0), backlog=128)
            sockets.append(tcp)
            if unix and sys.platform == "linux":
                local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets.append(local)
                local.bind(f"\0asyncrpc-lanes-{uuid.uuid4().hex}")
                local.listen(128)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        return cls(sockets, limit)

    def serve(self, serving: Serving) -> None:
        """The group is joined: lanes may authenticate and carry calls from now on."""
        self._serving = serving
        self._joined.set()

    # -- accepting -------------------------------------------------------------------------

    def _accept(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self._listening:
                selector.register(sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:  # bounded by close(), which writes the wake-up pipe
                for key, _ in selector.select():
                    if key.fileobj == self._wake_r or self._closed:
                        return
                    assert isinstance(key.fileobj, socket.socket)
                    self._take(key.fileobj)

    def _take(self, listening: socket.socket) -> None:
        try:
            sock, _ = listening.accept()
        except OSError:
            return  # the dialer gave up already
        with self._lock:
            full = self._open >= self._limit or self._closed
            if not full:
                self._open += 1
        if full:
            sock.close()  # the peer's caller takes the loop's path
            return
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._run, args=(sock,), name="asyncrpc-lane", daemon=True)
        thread.start()

    def _run(self, sock: socket.socket) -> None:
        lane = None
        try:
            serving = self._joined_serving()
            if serving is None:
                return
            opened = accept_lane(
                sock, (serving.name, serving.rank), serving.key, serving.max_frame_size,
                serving.roster, serving.handshake_timeout,
            )  # fmt: skip
            opened.frames.spin = serving.busy_poll
            lane = _Lane(opened.frames, opened.rank, opened.name)
            with self._lock:
                if self._closed:
                    lane.frames.close()
                    return
                self._lanes.add(lane)
            self._serve_lane(serving, lane)
        except HANDSHAKE_ERRORS as exc:  # TimeoutError too: an OSError
            _log.debug("a lane ended: %s", exc)
        finally:
            sock.close()
            with self._lock:
                self._open -= 1
                if lane is not None:
                    self._lanes.discard(lane)
                    retire(lane.frames, self._retired)
            if lane is not None:
                self._forget(lane)

    def _joined_serving(self) -> Serving | None:
        """Wait (bounded) for the group to be joined: a fast peer may dial before."""
        if not self._joined.wait(30.0) or self._serving is None:
            return None
        return self._serving

    # -- serving ---------------------------------------------------------------------------

    def _serve_lane(self, serving: Serving, lane: _Lane) -> None:
        frames = lane.frames
        while True:  # bounded by the lane: it ends when the caller closes it (or we do)
            try:
                frame = frames.read()
            except (ClosedError, OSError, ConnectionError):
                return
            message = decode_message(frame.fields)
            if isinstance(message, Request):
                self._count("calls_received")
                if message.mode == CallMode.CALL:
                    self._serve(serving, lane, message, frame)
                elif message.mode == CallMode.CODED:
                    self._serve_coded(serving, lane, message, frame)
                elif message.mode == CallMode.REMOTE:
                    self._serve_remote(serving, lane, message, frame)
                else:
                    return  # streams never travel on lanes: a confused peer loses its lane
            elif isinstance(message, Ack):
                lane.unacked.pop(message.call_id, None)
            # A Cancel names a call already answered (the lane runs one at a time).

    def _serve(self, serving: Serving, lane: _Lane, request: Request, frame: Frame) -> None:
        rank, pipeline, headers = lane.rank, serving.pipeline, request.headers
        incoming = None
        if pipeline.serves(headers):
            if not pipeline.on_lanes(headers):  # a hook that runs on the loop only
                start = serving.dispatcher.on_request
                self._hand_over(
                    serving, lane, request, start, frame.payload, frame.segments, frame.nbytes
                )
                return
            incoming = pipeline.received(
                lane.name, rank, serving.name, request.call_id, request.target, False, headers,
                frame.nbytes,
            )  # fmt: skip
        try:
            policy = None if incoming is None else incoming.policy
            call = serving.serializer.loads(
                frame.payload, frame.segments, context=rank, policy=policy
            )
        except MissingReferenceError as exc:
            error = missing_reference_error(serving.name, request, exc)
            self._reply_error(serving, lane, request, incoming, error)
            return
        except Exception as exc:
            self._reply_error(serving, lane, request, incoming, exc)
            return
        fn = call[0]
        if is_coroutine_function(fn) or is_async_execution(fn) or is_inline(fn):
            # These run on the loop (an @inline function may rely on it, as on one thread).
            on_loop = serving.dispatcher.on_unpickled
            self._hand_over(serving, lane, request, on_loop, call, incoming)
            return
        self._run_here(serving, lane, request, incoming, call)

    def _serve_coded(self, serving: Serving, lane: _Lane, request: Request, frame: Frame) -> None:
        """A coded call (``protocol/coded.py``): one of this worker's features' own,
        found by name, run here; its reply coded where no hook serves it."""
        self._count("coded_calls_received")
        coded = serving.coded.get(request.target)
        if coded is None:
            error = RemoteProtocolError(f"worker {serving.name!r} has no coded call "
                                        f"{request.target!r}")  # fmt: skip
            self._reply_error(serving, lane, request, None, error)
            return
        try:
            args = coded.load_args(frame.payload, frame.segments)
        except Exception as exc:
            self._reply_error(serving, lane, request, None, exc)
            return
        try:
            self._run_coded(serving, lane, request, frame, coded, args)
        finally:
            if coded.after_reply is not None:
                self._after_reply(coded.after_reply, args)

    def _run_coded(
        self, serving: Serving, lane: _Lane, request: Request, frame: Frame, coded: CodedCall,
        args: Any,
    ) -> None:  # fmt: skip
        call: tuple[Any, Any, Any] = (coded.run, args, {})
        pipeline, incoming = serving.pipeline, None
        if pipeline.serves(None):  # hooks that serve every request see it as a plain call
            if not pipeline.on_lanes(None):
                self._hand_over(serving, lane, request, serving.dispatcher.on_unpickled, call)
                return
            incoming = pipeline.received(
                lane.name, lane.rank, serving.name, request.call_id, request.target, False,
                None, frame.nbytes,
            )  # fmt: skip
        self._run_here(serving, lane, request, incoming, call, coded)

    @staticmethod
    def _after_reply(after: Callable[..., None], args: Any) -> None:
        try:
            after(*args)
        except Exception:  # the caller has its reply: nobody else would hear of this
            _log.exception("the work after a coded call's reply failed")

    def _serve_remote(self, serving: Serving, lane: _Lane, request: Request, frame: Frame) -> None:
        """A remote() request: its value stays here (nothing is written back but an Ack
        that the caller's fork is registered)."""
        rank = lane.rank
        serving.forks.on_remote_request(rank, request)
        hooked = serving.pipeline.serves(request.headers)
        if not hooked:  # the dispatcher watches the deadline of those it serves itself
            serving.run_on_loop(serving.dispatcher.watch_remote, rank, request)
        self._write(
            serving, lane, request, encode_frame(Ack(request.call_id).to_fields(), b""), None
        )
        if hooked:  # its hooks run on the loop
            start = serving.dispatcher.on_request
            serving.run_on_loop(
                start, self._no_reply(lane), request, frame.payload, frame.segments, frame.nbytes
            )
            return
        try:
            call = serving.serializer.loads(frame.payload, frame.segments, context=rank)
        except MissingReferenceError as exc:
            self._remote_value(
                serving, lane, request, False, missing_reference_error(serving.name, request, exc)
            )
            return
        except Exception as exc:
            self._remote_value(serving, lane, request, False, exc)
            return
        fn, args, kwargs = call
        if is_coroutine_function(fn) or is_async_execution(fn) or is_inline(fn):
            serving.run_on_loop(
                serving.dispatcher.on_unpickled, self._no_reply(lane), request, call
            )
            return
        run = partial(checked_op, fn) if is_torch_c_function(fn) else fn
        with self._lock:
            self.running += 1
        try:
            with running_until(deadline_after(request.timeout), lane.rank):
                value, ok = run(*args, **kwargs), True
        except BaseException as exc:  # the RRef's users get it when they fetch
            value, ok = exc, False
        finally:
            with self._lock:
                self.running -= 1
            del call, args, kwargs
        self._remote_value(serving, lane, request, ok, value)

    def _remote_value(
        self, serving: Serving, lane: _Lane, request: Request, ok: bool, value: Any
    ) -> None:
        if not ok and serving.print_errors:
            print_request_error(serving.name, request, lane.name, value)
        serving.forks.on_value(request, lane.rank, ok, value)

    def _no_reply(self, lane: _Lane) -> LaneReply:
        """The connection of a remote() request handed to the loop: none is written."""
        return LaneReply(lane.rank, lane.name)

    def _run_here(
        self, serving: Serving, lane: _Lane, request: Request, incoming: IncomingCall | None,
        call: tuple[Any, Any, Any], coded: CodedCall | None = None,
    ) -> None:  # fmt: skip
        """Run a plain function here, through the hooks that serve it, and reply (coded
        by ``coded`` where no hook served it and its codec can say the result)."""
        fn, args, kwargs = call
        if incoming is not None:
            run = serving.pipeline.serve(incoming, fn, args, kwargs)
        else:
            run = partial(checked_op, fn) if is_torch_c_function(fn) else fn
        with self._lock:
            self.running += 1
        try:
            with running_until(deadline_after(request.timeout), lane.rank):
                result = run(*args, **kwargs)
        except BaseException as exc:  # the caller gets it, as from a pool thread
            self._reply_error(serving, lane, request, incoming, exc)
            return
        finally:
            with self._lock:
                self.running -= 1
            del call, args, kwargs  # the arguments' RRefs are released now, not later
        if coded is not None and incoming is None:
            dumped = coded.dump_result(result)
            if dumped is not None:
                payload, segments, keep = dumped
                fields = Reply(request.call_id, _CODED_HEADERS).to_fields()
                pieces = encode_frame(fields, payload, segments)
                self._write(serving, lane, request, pieces, None, "replies_sent")
                del keep
                return
        self._reply(serving, lane, request, incoming, result)

    def _hand_over(
        self, serving: Serving, lane: _Lane, request: Request, start: Callable[..., None],
        *args: Any,
    ) -> None:  # fmt: skip
        """Run a request on the loop's path and write the reply the dispatcher builds."""
        reply = lane.pending = LaneReply(lane.rank, lane.name)
        serving.run_on_loop(start, reply, request, *args)
        built = reply.wait()
        lane.pending = None
        if built is None:
            return  # abandoned: the lane is closing
        pieces, keep, forks = built
        self._write(serving, lane, request, pieces, forks)
        del keep  # the reply's tensors may be freed once written

    def _reply(
        self, serving: Serving, lane: _Lane, request: Request, incoming: IncomingCall | None,
        result: Any,
    ) -> None:  # fmt: skip
        policy = None if incoming is None else incoming.reply_policy
        try:  # RRefs pickled before a failure: the serializer undoes their forks
            payload, segments, keep, forks = serving.serializer.dumps(
                result, context=lane.rank, policy=policy
            )
        except Exception as exc:
            error = SerializationError(
                f"the result of {request.target} on worker {serving.name!r} cannot be sent: {exc}"
            )
            error.__cause__ = exc
            self._reply_error(serving, lane, request, incoming, error)
            return
        headers = None
        if incoming is not None:  # sized only for the hooks: an untraced reply is not
            nbytes = body_nbytes(payload, segments)
            headers = serving.pipeline.reply_fields(incoming, True, result, nbytes)
        if forks:
            headers = {**(headers or {}), ACK_WANTED: 1}
        pieces = encode_frame(Reply(request.call_id, headers).to_fields(), payload, segments)
        self._write(serving, lane, request, pieces, forks, "replies_sent")
        del keep
        if incoming is not None:
            serving.pipeline.replied(incoming)

    def _reply_error(
        self, serving: Serving, lane: _Lane, request: Request, incoming: IncomingCall | None,
        exc: BaseException,
    ) -> None:  # fmt: skip
        if serving.print_errors:
            print_request_error(serving.name, request, lane.name, exc)
        pipeline = serving.pipeline
        payload = pack_exception(exc, serving.name)
        headers = None
        if incoming is not None:
            headers = pipeline.reply_fields(incoming, False, exc, body_nbytes(payload))
        pieces = encode_frame(ErrorReply(request.call_id, headers).to_fields(), payload)
        self._write(serving, lane, request, pieces, None, "errors_sent")

    def _write(
        self, serving: Serving, lane: _Lane, request: Request, pieces: list[Any], forks: Any,
        counter: str = "",
    ) -> None:  # fmt: skip
        """Write a reply, counted as ``counter`` once written (a reply the dispatcher built
        is counted there); its RRef forks are followed until the caller's Ack."""
        try:
            lane.frames.check_size(pieces)
        except FrameTooLargeError as exc:  # over the caller's limit: it gets this instead
            self._undelivered(serving, lane.rank, forks)
            self._reply_error(serving, lane, request, None, exc)
            return
        if forks:
            lane.unacked[request.call_id] = forks
        try:
            lane.frames.write(pieces)
        except (Unsent, ClosedError, OSError, ConnectionError):
            lane.frames.close()  # the caller is gone: its lane ends here (forks in doubt)
            return
        if counter:
            self._count(counter)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _undelivered(self, serving: Serving, rank: int, forks: Any) -> None:
        if forks:
            serving.forks.undelivered(rank, forks)

    def _forget(self, lane: _Lane) -> None:
        """A lane ended: a request it handed to the loop is cancelled, and forks whose
        Ack never came are in doubt (the owner asks the peer about them)."""
        serving = self._serving
        pending = lane.pending
        if pending is not None:
            pending.abandon()
            if serving is not None:
                serving.run_on_loop(serving.dispatcher.cancel_connection, pending)
        in_doubt = [fork for forks in lane.unacked.values() for fork in forks]
        if in_doubt and serving is not None:
            serving.run_on_loop(serving.forks.query_forks, lane.rank, in_doubt)

    # -- stopping --------------------------------------------------------------------------

    def on_peer_lost(self, rank: int) -> None:
        """Close the lanes ``rank`` opened: it is gone for good."""
        with self._lock:
            lanes = [lane for lane in self._lanes if lane.rank == rank]
        for lane in lanes:
            lane.frames.close()
            if lane.pending is not None:
                lane.pending.abandon()

    def close(self) -> None:
        """Stop accepting and close every lane (their threads end)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = list(self._lanes)
        self._joined.set()
        os.write(self._wake_w, b"x")
        for lane in lanes:
            lane.frames.close()
            if lane.pending is not None:
                lane.pending.abandon()
        if self._acceptor is not None:
            self._acceptor.join(timeout=1.0)
        for sock in self._listening:
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stats(self) -> dict[str, int]:
        """The lanes' own figures (``lanes_*``), and their share of the agent's counters."""
        with self._lock:
            lanes = list(self._lanes)
            summed = figures([lane.frames for lane in lanes], self._retired)
            return {
                "lanes_served": len(lanes), "lane_requests_served": self.counts["calls_received"],
                **self.counts, "bytes_in": summed["bytes_in"], "bytes_out": summed["bytes_out"],
                "lane_polls": summed["polls"], "lane_poll_hits": summed["poll_hits"],
            }  # fmt: skip
