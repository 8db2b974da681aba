"""Profiling as a feature of the agent: the call hook that makes RPC spans and records
what this worker serves (layer L3).

The agent builds it from its ports; the server profiler (``server.py``), which runs on a
worker without a handle on it, finds it through its ``FeatureSlot``.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrpc.profiling.hook import ProfilingHook
from asyncrpc.runtime.calls.pipeline import CallHook
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.ports import Ports

__all__ = ["PROFILING", "Profiling"]


class Profiling(Feature):
    """RPC profiling on one worker: its hook, and the worker's name for server spans."""

    name = "profiling"

    def __init__(self, ports: Ports) -> None:
        self.worker = ports.members.name
        self.hook = ProfilingHook(ports.members.rank)

    def hooks(self) -> Sequence[CallHook]:
        return (self.hook,)


PROFILING: FeatureSlot[Profiling] = FeatureSlot("profiling", "the profiling hook")
