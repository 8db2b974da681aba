"""What a running worker says about itself, for monitoring (layer L4): its counters
(``get_metrics``), those with its identity, peers and bookkeeping (``get_debug_info``), and
the publishing of a metrics endpoint that ``asyncrpc.metrics.serve`` opens while it runs.

Public API beside ``asyncrpc/api.py`` (``asyncrpc.get_metrics`` is this one): like it, it
reads the current agent itself.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from asyncrpc.errors import NotInitializedError
from asyncrpc.runtime.current import current_agent
from asyncrpc.runtime.group.endpoints import publish_or_log

__all__ = ["get_debug_info", "get_metrics", "publish_endpoint"]


def get_metrics() -> dict[str, Any]:
    """This worker's counters: calls, bytes, connections, thread pool, loop lag.

    Returns:
        A fresh dict of numbers, among them ``calls_sent``, ``calls_received``,
        ``calls_failed``, ``calls_timed_out``, ``pending_calls`` (calls of this worker
        waiting for a reply), ``running_requests`` (requests it runs for others),
        ``bytes_in``/``bytes_out``, ``open_connections``, ``connections_lost``,
        ``connections_idle_closed`` (closed by both sides for ``idle_timeout``),
        ``reconnects``, ``thread_pool_busy``/``thread_pool_idle``/``thread_pool_blocked``,
        ``thread_pool_queued`` (jobs waiting for a thread), ``loop_lag_ms``/
        ``loop_lag_max_ms`` (how late the event loop runs), the ``shm_*`` and ``stream*``
        counters and the thread hand-offs (``handoffs_*``).

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().metrics()


def get_debug_info() -> dict[str, Any]:
    """``get_metrics()`` plus identity, peers and RRef bookkeeping.

    What to read when a call hangs: ``pending_by_peer`` (this worker's calls waiting for
    a reply, by callee), ``running_requests``, ``lost_peers`` and ``rpc_timeout``.

    Returns:
        A fresh dict: ``name``, ``rank``, ``world_size``, ``rpc_timeout``,
        ``pending_by_peer``, ``lost_peers``, ``leaving`` (its shutdown has begun), every
        key of ``get_metrics()``, the RRef
        counts (``owner_rrefs``, ``user_rrefs``, ``pending_forks``, ``pending_users``,
        ``forks_queried``, ``forks_undelivered``, ``unacked_ref_frames``) and the call
        hooks' counters (``num_autograd_contexts``, ``autograd_*``, ``device_maps``...).

    Raises:
        NotInitializedError: no worker runs in this process.
    """
    return current_agent().debug_info()


def publish_endpoint(host: str, port: int) -> None:
    """Publish a metrics endpoint in the running worker's rendezvous store, if one runs.

    Args:
        host: the address the endpoint listens on (a wildcard is published as the
            worker's RPC address).
        port: its port.
    """
    # serve() after init_rpc: the running worker publishes it now (one served before is
    # published when the worker joins). A store round trip: off the loop thread when
    # called on it.
    try:
        agent = current_agent()
    except NotInitializedError:
        return
    group = agent.group
    publish = partial(publish_or_log, group.store.store, group.rank, host, port,
                      group.addresses[group.rank].host)  # fmt: skip
    if agent.loop.on_loop_thread():
        agent.loop.aio.run_in_executor(None, publish)
    else:
        publish()
