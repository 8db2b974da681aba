"""What the call pipeline's hooks give a stream, per item and per peer (layer L2.4, beside
``pipeline.py``, which names the stages): what an item's frame waits for, the policy of
the items a worker reads, and what rides on every stream frame between two workers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncrpc.protocol.serde.policy import TensorPolicy

__all__ = ["ItemReady", "ItemsIn", "StreamLinks"]

# Called after each item of a stream is pickled: what its frame waits for (None: nothing),
# and the bytes the item holds for its consumer outside its frame (tensors sent by handle),
# which the stream's byte credit counts as it counts the frame's own bytes.
ItemReady = Callable[[], tuple[Awaitable[None] | None, int]]


class ItemsIn(TensorPolicy):
    """The tensor policy of the items of one stream this worker consumes (``items_in``):
    one object for all of them, unpickled one after another on the loop."""

    __slots__ = ()

    def take(self) -> Callable[[], None] | None:
        """What the thread that reads the item just unpickled calls before it gets it (None:
        nothing); the next item starts afresh."""
        return None


class StreamLinks:
    """What one hook adds to the stream frames between this worker and one peer
    (``stream_links``), whichever end of the stream this worker is: a base that adds
    nothing."""

    __slots__ = ()

    def fields(self) -> dict[str, Any] | None:
        """Header fields for the next stream frame to the peer (None: none). Any thread;
        what it returns must reach the peer: call it only for a frame about to be sent."""
        return None

    def owed(self) -> Awaitable[None] | None:
        """Once a stream this worker consumed from the peer is over: what to wait for
        before one last frame (a ``StreamClose``) carries what this worker still owes the
        peer (None: nothing is owed). Agent's loop."""
        return None

    def dropped(self, tags: Sequence[str]) -> None:
        """An item from the peer arrived for a stream nobody reads any more: what its
        segments (by their tags) hold for this worker is let go unread (agent's loop)."""

    def unsent(self, tags: Sequence[str]) -> None:
        """An item pickled for the peer was never written (its stream closed first): what
        its segments took is taken back (agent's loop)."""
