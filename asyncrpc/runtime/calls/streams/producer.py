"""The producing side of streaming calls: runs a stream request's generator for its
consumer, never past the consumer's credit (layer L2.42, on the agent's loop).

An ``async def`` generator (or an ``async def`` function returning an async iterator) is
driven by a task on the loop; a plain generator is advanced on the agent's pool, one burst
of steps per grant of credit, and each item is pickled on the pool thread that made it, as
replies of synchronous functions are. Either way the generator is advanced only after a
credit has been reserved for the item it yields (``ProducerFlow``), so a stalled consumer
stops the producer within ``window`` items, or once the bytes of the items it made reach
the consumer's byte window.

An item whose frame must wait (the call pipeline's ``items_ready``: the GPU copies of its
CUDA tensors) is held in the stream's outbox, with the items behind it, by one task per
stream that awaits it on the loop (``_hold``): items leave in order, and the stream's end
or error follows the items made before it.

Every stream ends exactly once, through ``_end`` (generator exhausted), ``_fail`` (it
raised, or an item could not be pickled) or ``close`` (the consumer closed it, its
connection or peer is gone, or this worker shuts down); each removes it from the table and
tells the pipeline (``replying``). Closing also closes the generator: ``aclose()`` on the
loop for an async one; a plain one is closed on a pool thread (its ``finally`` may block),
by the thread advancing it if one is, once its current step returns.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from asyncrpc.errors import FrameTooLargeError, RpcTimeoutError, SerializationError
from asyncrpc.functions import is_coroutine_function, is_inline
from asyncrpc.protocol.serde import pack_exception
from asyncrpc.protocol.wire import encode_frame, frame_nbytes
from asyncrpc.protocol.wire.stream import StreamEnd, StreamError, encode_item, item_fields
from asyncrpc.runtime.calls.deadline import running_until
from asyncrpc.runtime.calls.pipeline import StreamLinks
from asyncrpc.runtime.calls.streams.closing import close_now
from asyncrpc.runtime.calls.streams.produced import (
    Dumps,
    Fields,
    Made,
    ProducerStream,
    Ready,
    Replying,
    item_nbytes,
)
from asyncrpc.runtime.calls.streams.sources import NOTHING
from asyncrpc.runtime.ports import Frames, Loop

__all__ = ["ProducerStream", "Producers"]

_CLOSED = object()  # a pool thread closed the generator itself
_JOIN_BYTES = 64 << 10  # item frames joined into one write, up to this many bytes
# Items of these exact types hold no tensor and no reference: pickle's own dumps makes the
# same bytes as the serializer, at a tenth of its cost (no pickler object, no hooks), and
# the consumer reads them with pickle's own loads (``STREAM_VALUE`` frames).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})
_PROTOCOL = 5  # the serializer's

_log = logging.getLogger(__name__)


class Producers:
    """The streams this worker produces, by (consumer's rank, stream id); loop thread only.

    Args:
        name: this worker's name, for errors.
        loop: the agent's loop and pool (async generators run on the one, plain ones on
            the other).
        frames: writes item frames on the connection the stream's request came on.
        undelivered: told the RRef forks of item frames that were never written.
    """

    def __init__(
        self, name: str, loop: Loop, frames: Frames,
        undelivered: Callable[[int, list[Any]], None],
    ) -> None:  # fmt: skip
        self._name, self._loop, self._pool = name, loop.aio, loop.pool
        self._write_frame, self._forks_undelivered = frames.write, undelivered
        self._streams: dict[tuple[int, int], ProducerStream] = {}
        self.items_sent = 0

    def __len__(self) -> int:
        return len(self._streams)

    # -- from the dispatcher -----------------------------------------------------------------

    def expect(
        self, conn: Any, peer: int, stream_id: int, target: str, timeout: float = 0.0,
        deadline: float | None = None,
    ) -> None:  # fmt: skip
        """A stream request arrived: hold its credit until its function starts (its
        arguments may still wait for RRef confirmations). ``deadline`` (monotonic) ends
        the whole stream, ``timeout`` being the limit it came from."""
        stream = ProducerStream(conn, peer, stream_id, target, timeout, deadline)
        self._streams[(peer, stream_id)] = stream
        if deadline is not None:
            delay = max(0.0, deadline - time.monotonic())
            stream.timer = self._loop.call_later(delay, self._expire, stream)

    def forget(self, peer: int, stream_id: int) -> None:
        """The request failed before its function started (the error goes as a reply)."""
        self._streams.pop((peer, stream_id), None)

    def start(
        self, peer: int, stream_id: int, fn: Any, run: Callable[..., Any], args: Any,
        kwargs: Any, replying: Replying, dumps: Dumps, fields: Fields | None = None,
        ready: Ready | None = None, links: StreamLinks | None = None,
    ) -> None:  # fmt: skip
        """Start the stream's function: ``fn`` decides where it runs, ``run`` (``fn`` as
        the pipeline's hooks wrapped it) is what is called, ``dumps`` pickles its items,
        ``fields`` gives each one's header fields, ``ready`` what its frame waits for, and
        ``links`` what every frame to the consumer carries (``StreamLinks``)."""
        stream = self._streams.get((peer, stream_id))
        if stream is None:  # closed before it could start
            replying(False, asyncio.CancelledError())
            return
        stream.replying, stream.dumps, stream.fields = replying, dumps, fields
        stream.ready, stream.links = ready, links
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn) or is_inline(fn):
            try:  # a generator function returns at once: its body runs when advanced
                result = run(*args, **kwargs)
            except BaseException as exc:
                self._fail(stream, exc)
                return
            self._adopt(stream, result)
        elif is_coroutine_function(fn):
            stream.task = self._loop.create_task(self._await_source(stream, run, args, kwargs))
        else:  # a plain function returning an iterable: it may block, so on the pool
            stream.running = True
            self._submit(stream, self._call_in_thread, stream, run, args, kwargs)

    # -- from the consumer -------------------------------------------------------------------

    def on_credit(self, peer: int, stream_id: int, count: int, nbytes: int = 0) -> None:
        """The consumer granted credit.

        Raises:
            RemoteProtocolError: a credit the stream's flow refuses (the agent aborts the
                connection).
        """
        stream = self._streams.get((peer, stream_id))
        if stream is None:
            return  # ended meanwhile
        stream.flow.grant(count, nbytes)
        self._pump(stream)

    def on_close(self, peer: int, stream_id: int) -> None:
        stream = self._streams.get((peer, stream_id))
        if stream is not None:
            self.close(stream)

    # -- closing -----------------------------------------------------------------------------

    def close(self, stream: ProducerStream, error: BaseException | None = None) -> None:
        """Stop ``stream``; with ``error``, the consumer is told (else it closed it)."""
        if stream.closed:
            return
        if error is not None:
            self._fail(stream, error, drain=False)  # nobody waits for held items now
        else:
            self._finish(stream, False, asyncio.CancelledError())
        self._close_source(stream)

    def close_connection(self, conn: Any) -> None:
        """``conn`` is gone: nobody reads the streams that came on it."""
        for stream in [s for s in self._streams.values() if s.conn is conn]:
            self.close(stream)

    def close_peer(self, peer: int) -> None:
        for stream in [s for s in self._streams.values() if s.peer == peer]:
            self.close(stream)

    def close_all(self, error: BaseException) -> None:
        """This worker shuts down: every consumer is told with ``error``."""
        for stream in list(self._streams.values()):
            self.close(stream, error)

    def _expire(self, stream: ProducerStream) -> None:
        """The stream's deadline: its generator is closed (its ``finally`` runs) and the
        consumer gets the timeout its own side would give."""
        stream.timer = None
        if not stream.closed:
            self.close(stream, RpcTimeoutError(self._name, stream.target, stream.timeout))

    # -- running -----------------------------------------------------------------------------

    async def _await_source(
        self, stream: ProducerStream, run: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        try:
            with running_until(stream.deadline, stream.peer):  # this task only
                result = await run(*args, **kwargs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            stream.task = None  # ending here: nothing to cancel
            self._fail(stream, exc)
            return
        stream.task = None
        if stream.closed:
            close_now(result)
        else:
            self._adopt(stream, result)

    def _adopt(self, stream: ProducerStream, result: Any) -> None:
        """Drive what the function returned: an async iterator on the loop, else on the pool."""
        if hasattr(result, "__aiter__"):
            stream.async_source = True
            stream.task = self._loop.create_task(self._drive(stream, result.__aiter__()))
            return
        try:
            stream.source = iter(result)
        except TypeError:
            error = TypeError(
                f"{stream.target} must be a generator (or return an iterator) to be streamed, "
                f"it returned {type(result).__name__}"
            )
            self._fail(stream, error)
            return
        self._pump(stream)

    async def _drive(self, stream: ProducerStream, source: AsyncIterator[Any]) -> None:
        flow = stream.flow
        serving = running_until(stream.deadline, stream.peer)  # time_remaining() inside
        serving.__enter__()  # in this task only: its context is its own
        # A bidirectional stream's sender hands over what it has queued without a coroutine
        # per item (``SendQueue.take_now``); other sources are awaited.
        take_now = getattr(source, "take_now", None)
        try:
            while not stream.closed:
                count = flow.take()  # all the credit: the bytes are checked after each item
                if count == 0:
                    stream.wakeup = self._loop.create_future()
                    await stream.wakeup
                    continue
                for _ in range(count):
                    item = NOTHING if take_now is None else take_now()
                    if item is NOTHING:
                        try:
                            item = await source.__anext__()
                        except StopAsyncIteration:
                            stream.task = None
                            self._end(stream)
                            return
                    self._write(stream, *self._encode(stream, flow.sent, item))
                    if stream.closed or (flow.byte_credit is not None and flow.byte_credit <= 0):
                        break
                flow.give_back()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            stream.task = None  # ending here: nothing to cancel
            self._fail(stream, exc)
        finally:
            stream.task = stream.wakeup = None
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    _log.exception("closing the stream of %s failed", stream.target)

    def _pump(self, stream: ProducerStream) -> None:
        """Credit arrived: advance the generator if it waits for credit."""
        if stream.closed:
            return
        if stream.async_source:
            wakeup = stream.wakeup
            if wakeup is not None and not wakeup.done():
                wakeup.set_result(None)
            return
        if stream.source is None or stream.running:
            return
        flow = stream.flow
        count = flow.take()
        if count:
            stream.running = True
            # The burst gets the byte credit left now: the thread stops once its items spend
            # it (credit granted meanwhile goes to the next burst).
            self._submit(
                stream, self._steps, stream, stream.source, flow.sent, count, flow.byte_credit
            )

    def _submit(self, stream: ProducerStream, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._pool.submit(fn, *args)
        except Exception as exc:  # shut down, or exhausted: the consumer learns it
            stream.running = False
            self.close(stream, exc)

    def _call_in_thread(
        self, stream: ProducerStream, run: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        # Pool thread: call a plain function that returns what is streamed.
        post = self._pool.post
        try:
            with running_until(stream.deadline, stream.peer):
                result = run(*args, **kwargs)
        except BaseException as exc:
            post(self._called, stream, exc, None)
            return
        post(self._called, stream, None, result)

    def _called(self, stream: ProducerStream, error: BaseException | None, result: Any) -> None:
        stream.running = False
        if error is not None:
            self._fail(stream, error)
        elif stream.closed:
            self._close_in_pool(stream, result)
        else:
            self._adopt(stream, result)

    def _steps(
        self, stream: ProducerStream, source: Iterator[Any], first: int, count: int,
        budget: int | None,
    ) -> None:  # fmt: skip
        # Pool thread: advance the generator ``count`` times (the credit reserved), pickling
        # each item here and handing it to the loop, in order. Stops early once closed, or
        # once the items made spent the ``budget`` of bytes (None: bytes not counted).
        # The burst runs in the request's deadline once, not once per item: between two
        # steps only the items are pickled.
        with running_until(stream.deadline, stream.peer):
            outcome = self._burst(stream, source, first, count, budget)
        if outcome is not None:
            self._pool.post(self._stepped, stream, outcome)
            return
        post = self._pool.post
        if stream.closed:  # here, not on the loop: this thread owns the generator now
            close_now(source)
            post(self._stepped, stream, _CLOSED)
            return
        post(self._stepped, stream, None)

    def _burst(
        self, stream: ProducerStream, source: Iterator[Any], first: int, count: int,
        budget: int | None,
    ) -> BaseException | None:  # fmt: skip
        """``_steps``'s loop; the exception that ended the stream (StopIteration too)."""
        post, write, encode = self._pool.post, self._write, self._encode
        spent = 0
        for seq in range(first, first + count):
            if stream.closed or (budget is not None and spent >= budget):
                break
            try:
                item = next(source)
                built = encode(stream, seq, item)
            except BaseException as exc:  # StopIteration too: the end
                return exc
            del item
            spent += built[5]
            post(write, stream, *built)
        return None

    def _stepped(self, stream: ProducerStream, outcome: object) -> None:
        """A burst of steps ended (loop): go on, end, fail, or close the generator."""
        stream.running = False
        if outcome is None and not stream.closed:
            stream.flow.give_back()
            self._pump(stream)
            return
        if outcome is _CLOSED or isinstance(outcome, BaseException):
            stream.source = None  # closed, exhausted or broken: nothing left to close
        if isinstance(outcome, StopIteration):
            self._end(stream)
        elif isinstance(outcome, BaseException):
            self._fail(stream, outcome)
        else:
            self._close_source(stream)

    def _close_source(self, stream: ProducerStream) -> None:
        if stream.task is not None:
            stream.task.cancel()  # its finally closes the async generator
            stream.task = None
        source, stream.source = stream.source, None
        if source is None:
            return
        if stream.running:
            stream.source = source  # the thread advancing it closes it (see _steps)
            return
        self._close_in_pool(stream, source)

    def _close_in_pool(self, stream: ProducerStream, source: Any) -> None:
        # Not on the loop: a generator's finally may block.
        try:
            self._pool.submit(close_now, source)
        except Exception:  # the pool is shut down: its finally runs when it is collected
            _log.debug("could not close the stream of %s on the pool", stream.target)

    # -- sending -----------------------------------------------------------------------------

    def _encode(
        self, stream: ProducerStream, seq: int, item: Any
    ) -> tuple[list[Any], Any, Any, Awaitable[None] | None, list[str] | None, int, int]:
        """Frame item ``seq`` (on the loop or a pool thread); returns the frame's pieces,
        what they keep alive, the RRef forks minted, what the frame waits for, its
        segments' tags (where the links need them back if it is never sent), the item's
        size in bytes (with those it holds by handle), and the frame's."""
        if type(item) in _PLAIN:
            return self._encode_plain(stream, seq, item)
        payload, segments, keep, forks = self._dumps(stream, seq, item)
        nbytes = item_nbytes(payload, segments)
        headers = None if stream.fields is None else stream.fields()
        wait, tags = None, None
        if stream.ready is not None:
            wait, held = stream.ready()
            nbytes += held  # by handle: the consumer's window counts them all the same
        links = stream.links
        if links is not None:
            headers = _with(headers, links.fields())
            tags = [tag for _, tag in segments] if segments else None
        fields = item_fields(stream.stream_id, seq, nbytes, headers)
        pieces: list[Any]
        if segments:
            pieces = encode_frame(fields, payload, segments)
            size = frame_nbytes(pieces)
        else:
            pieces, size = encode_item(stream.packer, fields, payload)
        return pieces, keep, forks, wait, tags, nbytes, size

    def _encode_plain(
        self, stream: ProducerStream, seq: int, item: Any
    ) -> tuple[list[Any], Any, Any, Awaitable[None] | None, list[str] | None, int, int]:
        """``_encode`` for a scalar: pickle's own bytes, no tensor (nothing to wait for or
        hold), no grad (no hook's item fields); only the links' fields, which ride on any
        frame to the consumer."""
        payload = pickle.dumps(item, _PROTOCOL)
        nbytes = len(payload)
        links = stream.links
        headers = None if links is None else links.fields()
        fields = item_fields(stream.stream_id, seq, nbytes, headers, True)
        pieces, size = encode_item(stream.packer, fields, payload)
        return pieces, None, None, None, None, nbytes, size

    def _dumps(self, stream: ProducerStream, seq: int, item: Any) -> Any:
        """Pickle item ``seq`` as the dispatcher chose (a reply's serializer arguments).

        Raises:
            SerializationError: it cannot be pickled (naming the item and the stream).
        """
        assert stream.dumps is not None
        try:  # RRefs pickled before a failure: the serializer undoes their forks
            return stream.dumps(item)
        except Exception as exc:
            error = SerializationError(
                f"item {seq} of {stream.target} on worker {self._name!r} cannot be sent: {exc}"
            )
            raise error from exc

    def _write(
        self, stream: ProducerStream, pieces: list[Any], keep: Any, forks: Any,
        wait: Awaitable[None] | None, tags: list[str] | None, nbytes: int, size: int,
    ) -> None:  # fmt: skip
        made = (pieces, keep, forks, wait, tags, size)
        if stream.closed:
            self._drop(stream, [made])
            return
        stream.flow.sent_one(nbytes)
        self.items_sent += 1
        stream.outbox.append(made)
        if not stream.flushing and stream.held is None:
            stream.flushing = True
            self._loop.call_soon(self._flush, stream)

    def _flush(self, stream: ProducerStream) -> None:
        """Write the items made since the last flush, small frames joined into writes of up
        to ``_JOIN_BYTES``: a fast generator's items leave in a few system calls per loop
        pass rather than one each. An item whose frame must wait (its GPU copies) stops
        the flush: it and the items behind it leave, in order, once it may (``_hold``)."""
        stream.flushing = False
        if stream.held is not None:
            return  # the held item's task flushes the rest once it left
        outbox, stream.outbox = stream.outbox, []
        if stream.closed:
            self._drop(stream, outbox)
            return
        limit = min(_JOIN_BYTES, getattr(stream.conn, "peer_max_frame", 0) or _JOIN_BYTES)
        joined: list[Any] = []
        keeps: list[Any] = []
        batch: list[Made] = []  # the items joined
        size = 0
        for index, made in enumerate(outbox):
            pieces, keep, forks, wait, _, nbytes = made
            if stream.closed:  # a write failed: the rest is not sent
                self._drop(stream, [made])
                continue
            if wait is not None:  # what is joined leaves; this one and the rest wait
                if joined:
                    self._send(stream, joined, keeps, batch)
                    joined, keeps, batch = [], [], []
                rest = [(pieces, keep, forks, None, made[4], nbytes), *outbox[index + 1 :]]
                if stream.closed:
                    self._drop(stream, rest)
                    return
                stream.outbox = rest + stream.outbox
                stream.held = self._loop.create_task(self._hold(stream, wait))
                return
            if joined and size + nbytes > limit:
                self._send(stream, joined, keeps, batch)
                joined, keeps, batch, size = [], [], [], 0
                if stream.closed:  # that write failed: this item is not sent either
                    self._drop(stream, [made])
                    continue
            joined += pieces
            keeps.append(keep)
            batch.append(made)
            size += nbytes
        if joined:
            self._send(stream, joined, keeps, batch)

    async def _hold(self, stream: ProducerStream, wait: Awaitable[None]) -> None:
        """Wait (on the loop, never blocking it) until the outbox's first item may leave,
        then flush; then the stream's end, if it came meanwhile. A wait that fails drops
        the item and those behind it and fails the stream with its error."""
        try:
            await wait
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            stream.held = None
            outbox, stream.outbox = stream.outbox, []
            self._drop(stream, outbox)
            stream.after_held = None
            self._fail(stream, exc)
            return
        stream.held = None
        self._flush(stream)
        after = stream.after_held
        if stream.held is None and after is not None:
            stream.after_held = None
            after()

    def _drop(self, stream: ProducerStream, made: list[Made]) -> None:
        """Items never to be written: their forks undone, what they hold taken back."""
        links = stream.links
        for _, _, forks, _, tags, _ in made:
            self._undelivered(stream, forks)
            if tags and links is not None:
                links.unsent(tags)

    def _send(
        self, stream: ProducerStream, pieces: list[Any], keeps: list[Any], batch: list[Made]
    ) -> None:
        """Write the joined frames of ``batch``; if the write is refused, they are dropped
        (forks undone, blocks taken back) and the stream fails."""
        forks = [fork for made in batch if made[2] for fork in made[2]]
        try:
            self._write_frame(stream.conn, pieces, tuple(keeps), forks or None)
        except FrameTooLargeError as exc:  # one item over the consumer's frame limit
            self._drop(stream, batch)
            self._fail(stream, exc)

    def _undelivered(self, stream: ProducerStream, forks: Any) -> None:
        if forks:
            self._forks_undelivered(stream.peer, forks)

    def _end(self, stream: ProducerStream) -> None:
        if stream.closed:
            return
        self._flush(stream)  # the items first
        if stream.closed:  # an item could not be written: failed instead
            return
        if stream.held is not None:  # items still wait for their copies: the end follows
            stream.after_held = lambda: self._end(stream)
            return
        count = stream.flow.sent
        headers = self._finish(stream, True, count)
        if stream.links is not None:
            headers = _with(headers, stream.links.fields())
        end = StreamEnd(stream.stream_id, count, headers)
        self._write_frame(stream.conn, encode_frame(end.to_fields(), b""))

    def _fail(self, stream: ProducerStream, exc: BaseException, drain: bool = True) -> None:
        """End the stream with ``exc``: after the items made before it (``drain``; those
        still held wait for their copies first), or at once, dropping them."""
        if stream.closed:
            return
        if not drain:
            self._unhold(stream)
        if stream.outbox:
            self._flush(stream)  # the items before the error first
            if stream.closed:
                return
        if stream.held is not None:
            stream.after_held = lambda: self._fail(stream, exc)
            return
        count = stream.flow.sent
        headers = self._finish(stream, False, exc)
        if stream.links is not None:
            headers = _with(headers, stream.links.fields())
        payload = pack_exception(exc, self._name)
        error = StreamError(stream.stream_id, count, headers)
        self._write_frame(stream.conn, encode_frame(error.to_fields(), payload))
        self._close_source(stream)

    def _finish(self, stream: ProducerStream, ok: bool, value: Any) -> dict[str, Any] | None:
        """Leave the table (once) and tell the pipeline; returns its reply fields."""
        stream.closed = True
        self._unhold(stream)
        self._streams.pop((stream.peer, stream.stream_id), None)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        replying, stream.replying = stream.replying, None
        return None if replying is None else replying(ok, value)

    def _unhold(self, stream: ProducerStream) -> None:
        """Drop the items held for their copies, and those behind them (never sent)."""
        held, stream.held, stream.after_held = stream.held, None, None
        if held is None:
            return
        held.cancel()
        outbox, stream.outbox = stream.outbox, []
        self._drop(stream, outbox)


def _with(headers: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    """A frame's header fields with ``more`` (the links'), whose keys are their own."""
    if not more:
        return headers
    return more if headers is None else {**headers, **more}
