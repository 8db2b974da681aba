"""Two agents in one process and one loop, joined by a ``socketpair``: the whole path from
the handshake to a reply, both ways, without a rendezvous, a listener or a worker process.

Each agent is built as ``Agent.start`` builds it after a join (a ``Group`` made by hand);
agent ``a`` dials ``b`` through a socketpair instead of TCP (the network's ``dial`` seam),
``b`` takes the other end as an accepted connection.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from asyncrpc.errors import RemoteCallError
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.options import RpcBackendOptions
from asyncrpc.rref.context import RRefs
from asyncrpc.rref.forks import Forks
from asyncrpc.runtime.agent import Agent
from asyncrpc.runtime.feature import Feature
from asyncrpc.runtime.group.join import Group
from asyncrpc.runtime.group.membership import Directory
from asyncrpc.runtime.lanes.server import LaneServer
from asyncrpc.runtime.net.listener import Listener
from asyncrpc.runtime.net.transport import Connection
from asyncrpc.runtime.ports import Frames, Loop, Ports

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]

ADDRESSES = {r: PeerAddress(n, r, "127.0.0.1", 1 + r) for r, n in enumerate(("a", "b"))}


def _forks(group: Group, options: RpcBackendOptions, loop: Loop, frames: Frames) -> Forks:
    return Forks(group.rank, group.name, loop, frames, group.directory.worker_info, "ignore")


def _features(ports: Ports, forks: Forks) -> list[Feature]:
    return [RRefs(forks, ports.calls, ports.loop)]


def _agent(rank: int, dial: Any = None) -> Agent:
    loop = asyncio.get_running_loop()
    store: Any = None  # no barrier and no look-up: the group is static and known
    group = Group(
        ADDRESSES[rank].name, rank, 2, ADDRESSES, b"k" * 32, None, Directory(ADDRESSES, None),
        store,
    )  # fmt: skip
    options = RpcBackendOptions(sync_lanes=0, heartbeat_interval=0)
    lanes = LaneServer.listen("127.0.0.1", False, 0)  # takes no lanes
    agent = Agent(group, Listener(loop), options, loop, _forks, _features, lanes, dial=dial)
    agent.network.start()
    return agent


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[Agent, Agent]]:
    loop = asyncio.get_running_loop()
    a_end, b_end = socket.socketpair()
    dialled: list[PeerAddress] = []

    async def dial(address: PeerAddress, factory: Callable[[], Connection]) -> Connection:
        dialled.append(address)
        _, conn = await loop.connect_accepted_socket(factory, a_end)
        return conn

    a, b = _agent(0, dial), _agent(1)
    await loop.connect_accepted_socket(b.network.accept, b_end)  # b's end: accepted
    yield a, b
    for agent in (a, b):
        await agent.shutdown(graceful=False)
    assert [address.name for address in dialled] == ["b"]  # one dial, one connection


def add(x: int, y: int) -> int:
    return x + y


# b's outbox, for a function b runs (neither agent is the process's current one).
_B_OUTBOX: list[Any] = []


async def ask_back(x: int) -> int:
    # On b: a call back to a, on the same connection (b has no dial of its own).
    return int(await _B_OUTBOX[0].call("a", add, (x, 1), {}, 5.0))


def fail() -> None:
    raise KeyError("on b")


async def test_Agents_over_a_socketpair_handshake_then_reply(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    assert await a.outbox.call("b", add, (1, 2), {}, 5.0) == 3  # dial, handshake, call, reply
    assert b.network.statistics()["open_connections"] == 1  # authenticated on both ends
    assert a.network.is_connected(1)
    assert b.network.is_connected(0)
    with pytest.raises(KeyError) as info:
        await a.outbox.call("b", fail, (), {}, 5.0)
    assert isinstance(info.value, RemoteCallError)  # the remote error, as its own type
    assert a.metrics()["calls_sent"] == 2
    assert b.metrics()["calls_received"] == 2


async def test_Agents_over_a_socketpair_call_back_on_the_same_connection(
    pair: tuple[Agent, Agent],
) -> None:
    a, b = pair
    _B_OUTBOX[:] = [b.outbox]
    try:
        assert await a.outbox.call("b", ask_back, (41,), {}, 5.0) == 42
    finally:
        _B_OUTBOX.clear()
    assert b.metrics()["calls_sent"] == 1  # b called a back without dialling
