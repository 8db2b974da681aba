"""Distributed autograd as a feature of the agent: its contexts, the credits of the passes
this worker is the root of, the batched releases and the call hook, made together (layer
L3).

The agent builds it once its calls exist, from its ports; nothing is made on first use.
The code that runs on a worker without a handle on it (the remote functions of a backward
pass and of releases, the public ``context``/``backward``) finds it through its
``FeatureSlot``: ``context_table()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrpc.autograd.context import ContextTable
from asyncrpc.autograd.hook import AutogradHook
from asyncrpc.autograd.release import Releases
from asyncrpc.protocol.coded import CodedCall
from asyncrpc.runtime.calls.pipeline import CallHook
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.ports import Ports

__all__ = ["AUTOGRAD", "DistAutograd", "context_table", "release_here"]


class DistAutograd(Feature):
    """Distributed autograd on one worker.

    Attributes:
        rank: this worker's rank (in context and message ids).
        calls: the calls the backward pass's hops and the releases go in.
        loop: the agent's loop and pool (local passes run on one or the other).
        contexts: the contexts this worker takes part in, with the pass credits.
        releases: left contexts whose release on other workers is still to send.

    Args:
        coded: the backward hop's coded call (``engine.HOP_CALL``), served on lanes.
    """

    name = "autograd"

    def __init__(self, ports: Ports, coded: Sequence[CodedCall] = ()) -> None:
        self.rank = ports.members.rank
        self._coded = tuple(coded)  # the engine's: its module finds this one by its slot
        self.calls = ports.calls
        self.loop = ports.loop
        self.contexts = ContextTable()
        self.releases = Releases(
            self.rank, self.contexts, ports.calls, ports.loop, ports.frames.is_lost, release_here
        )
        self.hook = AutogradHook(self.rank, self.contexts, self.releases)

    def hooks(self) -> Sequence[CallHook]:
        return (self.hook,)

    def coded_calls(self) -> Sequence[CodedCall]:
        return self._coded

    def flush(self) -> None:
        # Contexts left just before shutdown: their releases go now, not after a delay.
        self.releases.flush()


AUTOGRAD: FeatureSlot[DistAutograd] = FeatureSlot("autograd", "distributed autograd")


def context_table() -> tuple[DistAutograd, ContextTable]:
    """This worker's distributed autograd and its contexts.

    Raises:
        NotInitializedError: no worker runs here, or it runs without distributed autograd.
    """
    autograd = AUTOGRAD.get()
    return autograd, autograd.contexts


async def release_here(context_ids: list[int], sender: int) -> None:
    """Runs on a worker the contexts reached (an ``async def``: on its loop, no pool hop):
    drop them here and pass them on (``Releases.onward``)."""
    AUTOGRAD.get().releases.onward(context_ids, sender)
