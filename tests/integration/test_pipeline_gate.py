"""The call pipeline's ``ready`` stages with real worker processes over 127.0.0.1: a
request or a reply held back by a hook leaves once released, frames to one peer keep their
order behind it, and a wait that fails fails its call alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import asyncrpc
from asyncrpc.runtime.calls.pipeline import CallHook, OutgoingCall
from asyncrpc.runtime.current import current_agent
from tests.integration import gate_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


class Refused(Exception):
    """What the failing gate raises."""


class RequestHold(CallHook):
    """Holds requests for ``arrive`` whose label starts with "held" until ``release``;
    fails those whose label starts with "refused"."""

    def __init__(self) -> None:
        self.loop = current_agent().loop.aio
        self.released = threading.Event()  # set from the test's thread
        self.waiting = 0

    def ready(self, call: OutgoingCall) -> Any:
        label = call.args[0] if call.args else ""
        if not isinstance(label, str):
            return None
        if label.startswith("held"):
            return self._held()
        if label.startswith("refused"):
            return self._refused()
        return None

    async def _held(self) -> None:
        self.waiting += 1
        try:
            for _ in range(6000):  # bounded: 60 s at most
                if self.released.is_set():
                    return
                await asyncio.sleep(0.01)
            raise TimeoutError("the test never released the request")
        finally:
            self.waiting -= 1

    async def _refused(self) -> None:
        raise Refused("not this one")


@pytest.fixture
def request_hold(group: Group) -> Iterator[RequestHold]:
    asyncrpc.rpc_sync("w1", fns.forget_arrivals)
    hook = RequestHold()
    current_agent().pipeline.add(hook)
    try:
        yield hook
    finally:
        hook.released.set()
        current_agent().pipeline.remove(hook)


def test_held_request_leaves_once_released_and_later_frames_wait_behind_it(
    request_hold: RequestHold,
) -> None:
    held = asyncrpc.rpc_async("w1", fns.arrive, args=("held",))
    after = asyncrpc.rpc_async("w1", fns.arrive, args=("after",))
    # Asked through w3's own connection to w1: neither request may have reached w1 yet,
    # not even the one that is ready itself (it stays behind the held one).
    seen = asyncrpc.rpc_sync("w3", asyncrpc.rpc_sync, args=("w1", fns.arrivals))
    assert seen == []
    assert request_hold.waiting == 1
    assert not held.done()
    assert not after.done()
    request_hold.released.set()
    assert held.wait() == "held"
    assert after.wait() == "after"
    assert asyncrpc.rpc_sync("w1", fns.arrivals) == ["held", "after"]


def test_a_failing_wait_fails_its_call_alone(request_hold: RequestHold) -> None:
    refused = asyncrpc.rpc_async("w1", fns.arrive, args=("refused",))
    after = asyncrpc.rpc_async("w1", fns.arrive, args=("after",))
    with pytest.raises(Refused, match="not this one"):
        refused.wait()
    assert after.wait() == "after"
    assert asyncrpc.rpc_sync("w1", fns.arrivals) == ["after"]  # the refused one never left


@pytest.mark.asyncio
async def test_held_request_from_async_code_does_not_block_the_loop(
    request_hold: RequestHold,
) -> None:
    task = asyncio.ensure_future(asyncrpc.rpc_async("w1", fns.arrive, args=("held-async",)))
    # Another peer's calls go on meanwhile.
    assert await asyncrpc.rpc_async("w3", fns.arrive, args=("elsewhere",)) == "elsewhere"
    assert not task.done()
    request_hold.released.set()
    assert await asyncio.wait_for(task, 30) == "held-async"


def test_held_reply_is_written_once_released(group: Group) -> None:
    asyncrpc.rpc_sync("w1", fns.hold_replies)
    try:
        fut = asyncrpc.rpc_async("w1", fns.held_value, args=(21,))
        # The reply of a later request on the same connection overtakes the held one.
        assert asyncrpc.rpc_sync("w1", fns.replies_held) == 1
        assert not fut.done()
    finally:
        asyncrpc.rpc_sync("w1", fns.release_replies)
    assert fut.wait() == 42
