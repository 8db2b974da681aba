"""The one shape of a feature of a worker: what the agent tells it and asks of it (layer
L2.41).

RRefs, distributed autograd, profiling, CUDA device maps, streams and lanes touch every
call or every peer, yet the agent knows none of them: each is a ``Feature``, built from
the ports it uses, and the agent loops over them. A feature brings its call hooks and its
coded calls, takes the frames of its own kinds, hears when a connection or a peer is lost,
flushes what it holds back when a shutdown begins, reports its figures (trio's
``statistics()``: built from its state when asked) and closes. A new feature (deadlines,
exporters) plugs in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from asyncrpc.errors import PeerLostError
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.protocol.wire import Frame
from asyncrpc.runtime.calls.pipeline import CallHook

__all__ = ["Feature"]


class Feature:
    """Base of features: every method defaults to nothing; override what you use.

    Attributes:
        name: the feature's key in its agent (``FeatureSlot`` finds it by this name).
        kinds: the frame kinds it receives (``on_frame``); each kind has one owner.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[frozenset[int]] = frozenset()

    def hooks(self) -> Sequence[CallHook]:
        """Its hooks on the call pipeline, in order (asked once, when the agent is built)."""
        return ()

    def coded_calls(self) -> Sequence[CodedCall]:
        """Its calls with a wire format of their own (``protocol/coded.py``), served
        on this worker's lanes by name (asked once, when the agent is built)."""
        return ()

    def on_frame(self, conn: Any, frame: Frame) -> None:
        """An authenticated frame of one of its ``kinds`` (the agent's loop).

        Raises:
            RemoteProtocolError: the frame is malformed; the agent aborts the connection.
        """

    def on_connection_lost(self, rank: int, conn: Any, error: PeerLostError) -> None:
        """``conn`` to ``rank`` closed: what came or went on it may be lost (the loop)."""

    def on_peer_lost(self, rank: int, error: PeerLostError) -> None:
        """``rank`` is gone for good (the loop)."""

    def flush(self) -> None:
        """A shutdown begins (the loop): send now what is held back, so the graceful
        shutdown waits for it like any outstanding call, and stop consuming."""

    def statistics(self) -> dict[str, int | float]:
        """Its figures for ``get_metrics()``, built from its state now (any thread).

        A figure several parts report (calls counted on lanes and on the loop) is summed.
        """
        return {}

    def debug_info(self) -> dict[str, Any]:
        """What it adds to ``get_debug_info()`` beyond its statistics (any thread)."""
        return {}

    def close(self) -> None:
        """The worker stops (the loop): fail or drop what is still in flight."""
