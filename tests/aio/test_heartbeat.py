"""asyncio tests of asyncrpc.runtime.net.heartbeat.Heartbeat with fake connections."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncrpc.runtime.net.heartbeat import Heartbeat

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class FakeConn:
    def __init__(self, peer: int | None = 1) -> None:
        self.peer = peer
        self.bytes_in = 0
        self.closed = False
        self.sent: list[Any] = []

    def send(self, pieces: Any, keepalive: object = None) -> None:
        self.sent.append(pieces)


async def run(conns: list[FakeConn], seconds: float, chatty: FakeConn | None = None) -> dict:
    silent: dict[int, float] = {}
    pinged: list[int] = []
    beat = Heartbeat(
        asyncio.get_running_loop(), 0.02, 0.1, lambda: conns,
        lambda c: pinged.append(id(c)), lambda c, s: silent.setdefault(id(c), s),
    )  # fmt: skip
    beat.start()
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:  # bounded
        if chatty is not None:
            chatty.bytes_in += 10  # a peer that keeps talking
        await asyncio.sleep(0.005)
    beat.stop()
    return {"silent": silent, "pinged": pinged}


async def test_Heartbeat_silent_connection_is_pinged_then_reported() -> None:
    quiet = FakeConn()
    seen = await run([quiet], 0.3)
    assert id(quiet) in seen["pinged"]
    assert seen["silent"][id(quiet)] >= 0.1


async def test_Heartbeat_connection_that_receives_is_never_reported() -> None:
    chatty = FakeConn()
    seen = await run([chatty], 0.3, chatty=chatty)
    assert seen["silent"] == {}
    assert seen["pinged"] == []


async def test_Heartbeat_skips_handshaking_and_closed_connections() -> None:
    handshaking, closed = FakeConn(peer=None), FakeConn()
    closed.closed = True
    seen = await run([handshaking, closed], 0.3)
    assert seen == {"silent": {}, "pinged": []}


async def test_Heartbeat_interval_zero_is_off() -> None:
    quiet = FakeConn()
    reported: list[object] = []
    beat = Heartbeat(
        asyncio.get_running_loop(), 0, 0.1, lambda: [quiet], reported.append,
        lambda c, s: reported.append(c),
    )  # fmt: skip
    beat.start()
    await asyncio.sleep(0.2)
    beat.stop()
    assert reported == []
