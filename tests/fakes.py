"""Stand-ins shared by the in-process tests of the call path."""

from __future__ import annotations

from typing import Any

from asyncrpc.protocol.wire.messages import Request


class NoRRefs:
    """The RRef service's side the outbox and dispatcher use, holding no reference."""

    def take_minted(self) -> None:
        return None

    def take_unconfirmed(self) -> None:
        return None

    def take_unmade(self) -> None:
        return None

    def undelivered(self, rank: int, forks: Any) -> None:
        pass

    def on_remote_request(self, peer: int, request: Request) -> None:
        pass

    def on_value(self, request: Request, peer: int, ok: bool, value: Any) -> None:
        self.kept = (request.call_id, ok, value)
