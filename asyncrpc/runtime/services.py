"""What the runtime asks of the RRef layer above it, as a Protocol (layer L2).

The RRef layer (``asyncrpc/rref/``) sits above the runtime: it calls through the agent,
and the agent reaches it only through this interface, built by a factory the public API
hands to ``Agent.start``. So the runtime never imports the RRef layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from asyncrpc.protocol.wire.messages import RefMessage, Request

__all__ = ["RRefService"]


class RRefService(Protocol):
    """The RRef bookkeeping of one agent, as the agent, dispatcher and shutdown use it."""

    # -- pickling hooks (any thread) --
    def dump(self, obj: object, dest: object, made: list[Any]) -> tuple[Any, ...] | None: ...

    def load(self, pid: tuple[Any, ...], sender: object) -> object: ...

    # -- requests in REMOTE mode (the dispatcher, on the loop) --
    def on_remote_request(self, peer: int, request: Request) -> None: ...

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None: ...

    def take_unconfirmed(self) -> Any: ...

    # -- messages and failures (the agent, on the loop) --
    def on_message(self, peer: int, message: RefMessage) -> None: ...

    def on_peer_lost(self, rank: int) -> None: ...

    # -- forks inside other frames (see asyncrpc/protocol/reflog.py) --
    def undelivered(self, rank: int, forks: list[Any]) -> None: ...

    def query_forks(self, rank: int, forks: list[Any]) -> None: ...

    # -- graceful shutdown --
    def release_all_users(self) -> None: ...

    def quiescent(self) -> bool: ...

    def owner_leaks(self) -> list[Any]: ...

    def report_leaks(self) -> None: ...

    def debug_info(self) -> dict[str, int]: ...

    def close(self) -> None: ...


# Builds the RRef service of an agent once it knows its rank (after the rendezvous).
RRefFactory = Callable[[Any], RRefService]
