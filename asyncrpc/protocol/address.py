"""Where a worker listens: ``PeerAddress``, the record every member publishes when it joins
(layer L1, plain values: the network dials it, the group's rendezvous stores it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PeerAddress"]


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a worker listens."""

    name: str
    rank: int
    host: str
    port: int
    # This worker's CUDA device maps by callee name; callees invert them for replies.
    device_maps: dict[str, dict[str, str]] | None = None
    # Same host: the machine's identity (boot id and host name) and a Unix socket address
    # to try before TCP (None: the worker takes no Unix connections).
    host_id: str = ""
    unix_path: str | None = None
    # Where it takes lanes (asyncrpc/runtime/lanes/): one blocking connection per calling
    # thread of a peer, for synchronous calls. None: it takes none that way.
    lane_port: int | None = None
    lane_path: str | None = None
