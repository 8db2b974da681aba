"""The server profiler: record every request a worker serves (layer L3).

torch's ``_enable_server_process_global_profiler`` and ``_server_process_global_profile``
under names of our own. Call the functions on the worker to profile, or through RPC:
``rpc_sync("ps", asyncrpc.profiling.enable_server_profiler)``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torch.autograd.profiler_util import EventList

from asyncrpc.profiling.feature import PROFILING
from asyncrpc.profiling.merge import to_function_events
from asyncrpc.profiling.recorder import relabel

__all__ = ["disable_server_profiler", "enable_server_profiler", "server_profile"]


def enable_server_profiler() -> None:
    """Record every request this worker serves from now on, until ``disable_server_profiler``.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    PROFILING.get().hook.start_serving()


def disable_server_profiler() -> EventList:
    """Stop the server profiler; return what it recorded as torch ``FunctionEvent``s.

    Each request served is one event named ``<function> (<caller> -> <this worker>)``,
    with the torch ops it ran as its children, on this worker's clock (µs).

    Returns:
        A torch ``EventList``: ``key_averages()``, ``table()`` and the rest work on it.

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    profiling = PROFILING.get()
    hook, me = profiling.hook, profiling.worker
    events = EventList()
    for start_ns, caller, target, rows in hook.stop_serving():
        span = f"{target} ({caller} -> {me})"

        def name(event: str, span: str = span, target: str = target) -> str:
            return span if event == target else event

        events.extend(to_function_events(relabel(rows, name, start_ns / 1000, -1)))
    events._build_tree()  # one clock for all requests: parents and children by time
    return events


class server_profile:
    """``with server_profile() as prof:`` profiles every request this worker serves.

    After the block, ``prof.function_events`` holds the events (see
    ``disable_server_profiler``) and ``prof.key_averages()`` sums them by name.
    """

    def __init__(self) -> None:
        self.function_events: EventList | None = None

    def __enter__(self) -> server_profile:
        enable_server_profiler()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.function_events = disable_server_profiler()

    def key_averages(self) -> Any:
        """The recorded events summed by name (torch's ``EventList.key_averages``).

        Raises:
            RuntimeError: the ``with`` block has not ended yet.
        """
        if self.function_events is None:
            raise RuntimeError("the server profile has not finished yet")
        return self.function_events.key_averages()
