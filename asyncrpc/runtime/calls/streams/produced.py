"""One stream this worker produces: its state, and what its items are made of (layer
L2.42, on the agent's loop; ``producer.py`` drives it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgpack

from asyncrpc.protocol.wire.stream import ProducerFlow
from asyncrpc.runtime.calls.pipeline import StreamLinks
from asyncrpc.runtime.shm.shm import segment_nbytes

__all__ = ["Dumps", "Fields", "Made", "ProducerStream", "Ready", "Replying", "item_nbytes"]

# The pipeline's last look at the stream (the dispatcher's): ok, value -> reply fields.
Replying = Callable[[bool, Any], dict[str, Any] | None]
# Pickles one item for the consumer as a reply to it is pickled (the dispatcher's choice of
# serializer arguments): item -> (payload, segments, keepalive, RRef forks minted).
Dumps = Callable[[Any], tuple[bytes, list[Any], Any, list[Any] | None]]
# The call pipeline's header fields for the item just pickled (None: none), asked right
# after each ``Dumps`` on the same thread (distributed autograd's message ids).
Fields = Callable[[], dict[str, Any] | None]
# What the frame of the item just pickled waits for before it is written (None: nothing),
# and the bytes it holds outside its frame (by handle), asked after ``Fields`` on the same
# thread (the GPU copies of its CUDA tensors).
Ready = Callable[[], tuple[Awaitable[None] | None, int]]
# An item made and not yet written: its frame's pieces, what they keep alive, the RRef
# forks minted, what it waits for (None: nothing), its segments' tags where the stream's
# links take back what an unsent item holds (None: they need not), and the frame's size.
Made = tuple[list[Any], Any, Any, Awaitable[None] | None, list[str] | None, int]


class ProducerStream:
    """One stream this worker produces: its generator, credit and state."""

    __slots__ = (
        "after_held", "async_source", "closed", "conn", "deadline", "dumps", "fields", "flow",
        "flushing", "held", "links", "outbox", "packer", "peer", "ready", "replying",
        "running", "source", "stream_id", "target", "task", "timeout", "timer", "wakeup",
    )  # fmt: skip

    def __init__(
        self, conn: Any, peer: int, stream_id: int, target: str, timeout: float = 0.0,
        deadline: float | None = None,
    ) -> None:  # fmt: skip
        self.conn = conn
        self.peer = peer
        self.stream_id = stream_id
        self.target = target
        # The whole stream's limit (seconds; 0: none) as a deadline on this clock: the
        # generator is closed then, and the consumer told with an RpcTimeoutError.
        self.timeout, self.deadline = timeout, deadline
        self.timer: asyncio.TimerHandle | None = None
        self.flow = ProducerFlow()
        # Packs its items' headers: they are framed on one thread at a time (the loop, or
        # the one pool thread advancing its generator), and a packer per frame costs.
        self.packer = msgpack.Packer()
        self.closed = False  # ended, failed or closed: nothing more is sent
        self.replying: Replying | None = None  # set when the function starts
        self.dumps: Dumps | None = None  # likewise
        self.fields: Fields | None = None  # likewise, when the hooks have item fields
        self.ready: Ready | None = None  # likewise, when the hooks may hold an item's frame
        # What the hooks add to every frame to the consumer (None: nothing; CUDA IPC).
        self.links: StreamLinks | None = None
        # A plain iterator, advanced on the pool (None: none, or handed back to be closed).
        self.source: Iterator[Any] | None = None
        self.running = False  # a pool job is advancing ``source``
        self.async_source = False
        self.task: asyncio.Task[None] | None = None  # drives an async iterator
        self.wakeup: asyncio.Future[None] | None = None  # the task waits for credit
        # Item frames made since the last write, written together (see Producers._flush).
        self.outbox: list[Made] = []
        self.flushing = False  # a flush is scheduled
        # The task awaiting the outbox's first item (its GPU copies): the items behind it
        # wait in the outbox, so that none overtakes it. None: nothing held.
        self.held: asyncio.Task[None] | None = None
        # The stream's end (or failure), written once the held items have left.
        self.after_held: Callable[[], None] | None = None


def item_nbytes(payload: Any, segments: list[Any]) -> int:
    """An item's cost in byte credit: its payload and tensor segments as sent, a segment
    placed in shared memory by the bytes it holds there (it skips the socket but holds the
    same memory until consumed, which is what the window bounds)."""
    size = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
    for view, tag in segments:
        size += segment_nbytes(view, tag)
    return size
