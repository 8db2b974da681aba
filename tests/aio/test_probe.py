"""The liveness probe (asyncrpc/runtime/lanes/probe.py) against plain sockets on 127.0.0.1:
a listener that never answers (a stopped process: the kernel accepts, nobody speaks), a
port where nothing listens, and the rule that a listener never seen to answer proves
nothing."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.runtime.lanes.probe import ProcessProbe, probe_process

pytestmark = pytest.mark.timeout(20)

ME, PEER, KEY = ("w0", 0), ("w1", 1), b"k" * 32


@pytest.fixture
def mute_listener() -> Iterator[int]:
    """A port whose listener never accepts nor speaks: a stopped process's, to a dialer."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_probe_process_a_listener_that_never_answers_is_a_timeout(mute_listener: int) -> None:
    evidence = probe_process(("127.0.0.1", mute_listener), ME, PEER, KEY, 1 << 20, 0.2)
    assert evidence == "and its process did not answer a probe within 0.2 s"


def test_probe_process_nothing_listening_is_a_gone_process() -> None:
    evidence = probe_process(("127.0.0.1", closed_port()), ME, PEER, KEY, 1 << 20, 0.2)
    assert evidence is not None
    assert "nothing listens" in evidence


async def _probe(port: int, trusted: bool) -> str | None:
    loop = asyncio.get_running_loop()
    address = PeerAddress("w1", 1, "127.0.0.1", 1, lane_port=port)
    probe = ProcessProbe(loop, ME, {1: address}, None, KEY, 1 << 20, 0.2)
    if trusted:
        probe._answered.add(1)  # its listener answered this worker before
    answered: asyncio.Future[str | None] = loop.create_future()

    class Conn:
        peer = 1

    assert probe(Conn(), answered.set_result) is True
    return await asyncio.wait_for(answered, 5.0)


@pytest.mark.asyncio
async def test_ProcessProbe_a_listener_never_seen_to_answer_proves_nothing(
    mute_listener: int,
) -> None:
    # A lane address this worker cannot reach (a firewall, a wrong interface) must not make
    # a live peer, whose main connection is merely silent, look dead.
    assert await _probe(mute_listener, trusted=False) is None
    assert await _probe(closed_port(), trusted=False) is None


@pytest.mark.asyncio
async def test_ProcessProbe_a_listener_that_answered_before_and_now_does_not_is_evidence(
    mute_listener: int,
) -> None:
    assert "did not answer" in (await _probe(mute_listener, trusted=True) or "")
    assert "nothing listens" in (await _probe(closed_port(), trusted=True) or "")


@pytest.mark.asyncio
async def test_ProcessProbe_without_a_lane_address_makes_no_probe() -> None:
    loop = asyncio.get_running_loop()
    address = PeerAddress("w1", 1, "127.0.0.1", 1)  # no lane port: sync_lanes=0, or TLS
    probe = ProcessProbe(loop, ME, {1: address}, None, KEY, 1 << 20, 0.2)

    class Conn:
        peer = 1

    assert probe(Conn(), lambda evidence: None) is False
    probe.notice(Conn())  # nothing to check either
