"""Lanes over real processes: ``rpc_sync`` from a user thread on its own connection to the
callee (``asyncrpc/runtime/lanes/``), and what still goes through the event loop.

The shared group's driver (this process) calls w1 and w3; each test starts from a thread
of its own where it matters which thread holds which lane.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc.protocol import auth
from asyncrpc.protocol.wire import MAGIC, PROTOCOL_VERSION, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import (
    Auth,
    CallMode,
    Hello,
    HelloReply,
    Request,
    decode_message,
)
from asyncrpc.runtime.lanes.client import LANES_PER_PEER
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group
from tests.integration.rawpeer import closed_by_peer, published_address
from tests.ordering import eventually

pytestmark = pytest.mark.timeout(120)

_PRELUDE = struct.Struct("!4sBBHIIQ")  # the wire prelude (asyncrpc/protocol/wire/frame.py)


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread (its own lanes) and return its result or raise its error."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=60)


def _lane_calls() -> int:
    return int(asyncrpc.get_metrics()["lane_calls"])


def test_Lanes_second_sync_call_takes_the_threads_lane(group: Group) -> None:
    def run() -> tuple[int, int, int]:
        before = _lane_calls()
        first = asyncrpc.rpc_sync("w1", fns.add, args=(1, 2))  # the loop's path
        after_first = _lane_calls()
        values = [asyncrpc.rpc_sync("w1", fns.add, args=(i, 1)) for i in range(5)]
        assert values == [1, 2, 3, 4, 5]
        return first, after_first - before, _lane_calls() - after_first

    first, on_lane_first, on_lane_after = _in_thread(run)
    assert first == 3
    assert on_lane_first == 0
    assert on_lane_after == 5
    served = asyncrpc.rpc_sync("w1", fns.metrics)["lane_requests_served"]
    assert served >= 5


def test_Lanes_callee_runs_a_def_on_the_lanes_thread(group: Group) -> None:
    def run() -> list[str]:
        return [asyncrpc.rpc_sync("w3", fns.whoami) for _ in range(3)]

    assert _in_thread(run) == ["w3", "w3", "w3"]

    def names() -> list[str]:
        return [asyncrpc.rpc_sync("w3", fns.thread_name) for _ in range(2)]

    # The thread that ran it: a pool thread for a thread's first call, its lane's next.
    first, second = _in_thread(names)
    assert second == "asyncrpc-lane", (first, second)
    assert first.startswith("asyncrpc-w3-"), first


def test_Lanes_remote_exceptions_keep_their_type(group: Group) -> None:
    def run() -> list[BaseException]:
        errors = []
        asyncrpc.rpc_sync("w1", fns.noop)  # the next ones take the lane
        for fn, args in ((fns.raise_key_error, ("k",)), (fns.raise_custom, ("boom",)),
                         (fns.raise_os_error, ())):  # fmt: skip
            try:
                asyncrpc.rpc_sync("w1", fn, args=args)
            except Exception as exc:  # the observation is the error
                errors.append(exc)
        return errors

    key, custom, oserror = _in_thread(run)
    assert isinstance(key, KeyError)
    assert isinstance(custom, fns.CustomError)
    assert "boom" in str(custom)
    # An OSError raised by the function is the function's error, not the lane's.
    assert isinstance(oserror, OSError)
    assert not isinstance(oserror, asyncrpc.PeerLostError)


def test_Lanes_timeout_leaves_the_lane_usable_and_drops_the_late_reply(group: Group) -> None:
    def run() -> tuple[BaseException | None, list[Any], int]:
        asyncrpc.rpc_sync("w1", fns.noop)
        asyncrpc.rpc_sync("w1", fns.noop)  # the lane is open now
        opened = asyncrpc.get_metrics()["lanes_opened"]
        error = None
        try:
            asyncrpc.rpc_sync("w1", fns.sleep, args=(1.0,), timeout=0.2)
        except Exception as exc:  # the observation is the error
            error = exc
        # The late reply ("slept") comes on the same lane and must not answer these.
        later = [asyncrpc.rpc_sync("w1", fns.add, args=(i, 10)) for i in range(3)]
        return error, later, asyncrpc.get_metrics()["lanes_opened"] - opened

    error, later, reopened = _in_thread(run)
    assert isinstance(error, asyncrpc.RpcTimeoutError)
    assert isinstance(error, TimeoutError)
    assert later == [10, 11, 12]
    assert reopened == 0  # the same lane served the later calls


def test_Lanes_async_def_goes_through_the_callees_loop(group: Group) -> None:
    def run() -> tuple[list[int], int]:
        before = _lane_calls()
        values = [asyncrpc.rpc_sync("w1", fns.async_add, args=(i, 1)) for i in range(3)]
        return values, _lane_calls() - before

    values, on_lanes = _in_thread(run)
    assert values == [1, 2, 3]
    assert on_lanes == 0


def test_Lanes_rref_returned_on_a_lane_is_freed_once_dropped(group: Group) -> None:
    owned_before = asyncrpc.rpc_sync("w3", fns.rref_debug)["owner_rrefs"]

    def run() -> tuple[list[float], int]:
        asyncrpc.rpc_sync("w3", fns.noop)
        before = _lane_calls()
        rrefs = [asyncrpc.rpc_sync("w3", fns.owned_here, args=(torch.full((2,), float(i)),))
                 for i in range(3)]  # fmt: skip
        values = [float(r.to_here().sum()) for r in rrefs]
        return values, _lane_calls() - before

    values, on_lanes = _in_thread(run)
    assert values == [0.0, 2.0, 4.0]
    assert on_lanes == 3

    # The owner's forks were acknowledged (Ack) and the users dropped: none is left.
    def owned() -> int:
        return int(asyncrpc.rpc_sync("w3", fns.rref_debug)["owner_rrefs"])

    assert eventually(lambda: owned() <= owned_before, 10.0), owned()


def test_Lanes_rref_sent_home_on_a_lane(group: Group) -> None:
    counter = asyncrpc.remote("w1", fns.make_counter, args=(5,))

    def run() -> list[Any]:
        return [asyncrpc.rpc_sync("w1", fns.local_value_of, args=(counter,)).count
                for _ in range(3)]  # fmt: skip

    assert _in_thread(run) == [5, 5, 5]


def test_Lanes_many_threads_share_a_bounded_number_of_lanes(group: Group) -> None:
    threads = LANES_PER_PEER + 4

    def run(i: int) -> list[int]:
        return [asyncrpc.rpc_sync("w1", fns.add, args=(i, j)) for j in range(4)]

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(run, range(threads)))
    assert results == [[i + j for j in range(4)] for i in range(threads)]
    assert asyncrpc.get_metrics()["lanes_open"] <= 2 * LANES_PER_PEER  # w1, and w3 above


def test_Lanes_server_profiler_sees_requests_on_lanes(group: Group) -> None:
    def run() -> list[Any]:
        asyncrpc.rpc_sync("w3", fns.noop)
        asyncrpc.rpc_sync("w3", asyncrpc.profiling.enable_server_profiler)  # on the lane
        values = [asyncrpc.rpc_sync("w3", fns.add, args=(i, 1)) for i in range(3)]
        events = asyncrpc.rpc_sync("w3", fns.stop_server_profiler_names)
        return [values, events]

    values, names = _in_thread(run)
    assert values == [1, 2, 3]
    assert sum(1 for n in names if "add" in n and "driver -> w3" in n) == 3, names


# -- strangers on the lane port: nothing is read past the caps or unpickled before the key --


def _lane_port(rank: int) -> int:
    port = published_address(rank).lane_port
    assert port is not None
    return port


def _frame(message: Any) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(message.to_fields(), b""))


def _still_serves_lanes(to: str) -> bool:
    def run() -> list[int]:
        return [asyncrpc.rpc_sync(to, fns.add, args=(i, 1)) for i in range(3)]

    before = _lane_calls()
    values = _in_thread(run)
    return values == [1, 2, 3] and _lane_calls() - before == 2


def test_Lanes_garbage_and_early_requests_are_closed_unread(group: Group) -> None:
    closed, got = closed_by_peer(_lane_port(1), b"GARBAGE!" * 8, 10.0)
    assert closed
    assert got == b""
    request = Request(1, 0.0, CallMode.CALL, "tests.integration.remote_fns.noop")
    early = b"".join(bytes(p) for p in encode_frame(request.to_fields(), b"not a pickle"))
    closed, got = closed_by_peer(_lane_port(1), early, 10.0)
    assert closed
    assert got == b""
    assert _still_serves_lanes("w1")


def test_Lanes_oversized_frame_before_the_key_is_closed_before_allocating(group: Group) -> None:
    prelude = _PRELUDE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 16, 0, 1 << 40)
    closed, got = closed_by_peer(_lane_port(3), prelude + b"\x90" * 16, 10.0)
    assert closed
    assert got == b""
    assert _still_serves_lanes("w3")


def test_Lanes_a_stranger_without_the_key_is_refused(group: Group) -> None:
    # A Hello under w1's own name: the acceptor challenges, the stranger cannot prove the
    # key, and the lane closes without running anything.
    hello = Hello(PROTOCOL_VERSION, "driver", 0, auth.new_nonce(), 0)
    with socket.create_connection(("127.0.0.1", _lane_port(1)), timeout=10.0) as sock:
        sock.settimeout(10.0)
        sock.sendall(_frame(hello))
        decoder = FrameDecoder()
        frames: list[Any] = []
        while not frames:  # bounded by the socket's timeout
            chunk = sock.recv(4096)
            assert chunk, "closed before the challenge"
            frames = decoder.feed(chunk)
        reply = decode_message(frames[0].fields)
        assert isinstance(reply, HelloReply)
        assert reply.accepted
        sock.sendall(_frame(Auth(b"\0" * 32)))
        request = Request(2, 0.0, CallMode.CALL, "tests.integration.remote_fns.noop")
        sock.sendall(b"".join(bytes(p) for p in encode_frame(request.to_fields(), b"x")))
        rest = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                rest += chunk
    assert rest == b""  # no reply: the request was never read
    assert _still_serves_lanes("w1")


def test_Lanes_a_silent_dialer_is_closed_at_the_handshake_deadline(group: Group) -> None:
    # The worker's handshake_timeout (5 s by default) bounds every read before the key.
    closed, got = closed_by_peer(_lane_port(3), b"", 30.0)
    assert closed
    assert got == b""


# -- faults: a peer killed mid-call on a lane; lanes turned off ------------------------------


def test_Lanes_call_to_a_killed_peer_fails_with_PeerLostError(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [spawn_worker("w1", 1, 2, init, log_dir=tmp_path, shutdown_timeout=10.0)]
    driver = scenarios.start("lane_killed", "--init-method", init)
    try:
        driver.wait_line("STARTED", 60.0)
        workers[0].kill()
        driver.send("KILLED")
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        stop_workers(workers, timeout=10.0)
    assert code == 0, driver.text()
    assert obs["running_on_w1"] is True
    error = obs["call"]["error"]
    assert error is not None, obs["call"]
    assert error["type"] == "PeerLostError", error
    assert error["worker"] == "w1"
    assert "its lane broke" in error["message"]  # it ran on the lane (a detail)
    assert obs["detected_after"] < 5.0  # the lane's socket broke: no timeout was waited
    assert obs["later"]["error"]["type"] == "PeerLostError"
    assert obs["shutdown"]["error"] is None, obs["shutdown"]


@pytest.mark.parametrize(("driver_lanes", "worker_lanes"), [(0, 0), (64, 0)])
def test_Lanes_off_on_either_side_means_every_call_takes_the_loop(
    tmp_path: Path, driver_lanes: int, worker_lanes: int
) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [spawn_worker("w1", 1, 2, init, log_dir=tmp_path, shutdown_timeout=30.0,
                            extra_args=["--sync-lanes", str(worker_lanes)])]  # fmt: skip
    driver = scenarios.start("lanes_off", "--init-method", init, "--sync-lanes", str(driver_lanes))
    try:
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        codes = stop_workers(workers, timeout=30.0)
    assert code == 0, driver.text()
    assert obs["values"] == [1, 2, 3, 4, 5]
    assert obs["lanes_opened"] == 0
    assert obs["lane_calls"] == 0
    assert obs["shutdown"]["error"] is None
    assert codes == [0]


def test_Lanes_busy_poll_answers_as_without_it(tmp_path: Path) -> None:
    # Both sides poll their lanes (2 ms): replies that come within the poll, one that
    # comes after it (the reader then sleeps as without polling), a remote error.
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [spawn_worker("w1", 1, 2, init, log_dir=tmp_path, shutdown_timeout=30.0,
                            extra_args=["--busy-poll-us", "2000"])]  # fmt: skip
    driver = scenarios.start("busy_poll", "--init-method", init, "--busy-poll-us", "2000")
    try:
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        codes = stop_workers(workers, timeout=30.0)
    assert code == 0, driver.text()
    assert obs["values"] == list(range(1, 51))
    assert obs["slow"]["value"] == "slept", obs["slow"]
    assert obs["error"]["error"]["type"] == "KeyError", obs["error"]
    assert obs["after"] == 5
    assert obs["lane_calls"] >= 50  # they went on the thread's lane, where polling is
    # The driver polled for its replies: the quick ones came within the poll, the 50 ms
    # one did not (its thread slept); w1's lane thread polled for the next requests.
    assert obs["lane_polls"] >= 50
    assert 0 < obs["lane_poll_hits"] < obs["lane_polls"]
    assert obs["w1"]["lane_polls"] >= 50
    assert obs["shutdown"]["error"] is None
    assert codes == [0]


def test_Lanes_carry_calls_inside_a_distributed_autograd_context(group: Group) -> None:
    # The autograd hook is lane-safe: a forward inside a context takes the thread's lane,
    # the callee records it in the context on its lane thread, and the backward reaches
    # the remote parameters as through the loop.
    from asyncrpc import autograd as dist_autograd
    from tests.integration import autograd_fns as afns

    layer = asyncrpc.remote("w1", afns.make_linear, args=(3, 4, 4))
    x = torch.arange(8.0).reshape(2, 4).requires_grad_()

    def run() -> tuple[int, list[torch.Tensor | None], torch.Tensor | None]:
        asyncrpc.rpc_sync("w1", fns.noop)  # the thread's first call opens nothing
        before = _lane_calls()
        with dist_autograd.context() as context_id:
            y = asyncrpc.rpc_sync("w1", afns.forward, args=(layer, x))
            y = asyncrpc.rpc_sync("w1", afns.forward, args=(layer, torch.relu(y)))
            on_lanes = _lane_calls() - before
            dist_autograd.backward(context_id, [y.sum()])
            remote = asyncrpc.rpc_sync("w1", afns.grads_of, args=(context_id, layer))
            local = dist_autograd.get_gradients(context_id).get(x)
        return on_lanes, remote, local

    on_lanes, remote, local = _in_thread(run)
    assert on_lanes == 2
    # The same model run locally: the gradients are the same numbers.
    lin = afns.make_linear(3, 4, 4)
    xl = torch.arange(8.0).reshape(2, 4).requires_grad_()
    lin(torch.relu(lin(xl))).sum().backward()
    assert local is not None
    assert torch.allclose(local, xl.grad)
    assert remote[0] is not None
    assert torch.allclose(remote[0], lin.weight.grad)


def test_Lanes_sync_call_behind_a_pending_async_call_takes_its_connection(group: Group) -> None:
    # rpc_async then rpc_sync to one worker from one thread: the callee starts them in that
    # order, as on one connection; once the async call is over, the lane serves again.
    def run() -> tuple[int, int, list[Any]]:
        asyncrpc.rpc_sync("w1", fns.noop)
        asyncrpc.rpc_sync("w1", fns.noop)  # the lane is open now
        before = _lane_calls()
        pending = asyncrpc.rpc_async("w1", fns.sleep, args=(0.3,))
        behind = asyncrpc.rpc_sync("w1", fns.add, args=(1, 1))
        during = _lane_calls() - before
        slept = pending.wait()
        after = asyncrpc.rpc_sync("w1", fns.add, args=(2, 2))
        return during, _lane_calls() - before, [behind, slept, after]

    during, total, values = _in_thread(run)
    assert values == [2, "slept", 4]
    assert during == 0
    assert total == 1


def test_Lanes_carry_remote_and_to_here_in_order(group: Group) -> None:
    owned_before = asyncrpc.rpc_sync("w3", fns.rref_debug)["owner_rrefs"]

    def run() -> tuple[list[float], int, type[BaseException] | None]:
        asyncrpc.rpc_sync("w3", fns.noop)
        asyncrpc.rpc_sync("w3", fns.noop)  # the lane is open now
        before = _lane_calls()
        values = []
        for i in range(3):  # each to_here right behind its remote(), on the same lane
            rref = asyncrpc.remote("w3", fns.filled, args=(4, float(i)))
            values.append(float(rref.to_here().sum()))
        on_lanes = _lane_calls() - before
        failing = asyncrpc.remote("w3", fns.raise_key_error, args=("gone",))
        try:
            failing.to_here()
        except Exception as exc:  # the observation is the error's type: its traceback
            return values, on_lanes, type(exc)  # would hold this frame and its RRefs
        return values, on_lanes, None

    values, on_lanes, error = _in_thread(run)
    assert values == [0.0, 4.0, 8.0]
    assert on_lanes == 6  # three remote() requests and three fetches
    assert error is not None
    assert issubclass(error, KeyError)

    def owned() -> int:
        return int(asyncrpc.rpc_sync("w3", fns.rref_debug)["owner_rrefs"])

    assert eventually(lambda: owned() <= owned_before, 10.0), owned()


def test_Lanes_remote_on_a_lane_fetched_from_another_thread(group: Group) -> None:
    # The remote() leaves on one thread's lane; another thread, with no lane, fetches it
    # over the loop's path: the owner waits for the remote() if it is not there yet.
    def make() -> Any:
        asyncrpc.rpc_sync("w1", fns.noop)
        asyncrpc.rpc_sync("w1", fns.noop)
        return asyncrpc.remote("w1", fns.filled, args=(3, 2.0))

    rref = _in_thread(make)
    assert float(_in_thread(lambda: rref.to_here().sum())) == 6.0


def test_Lanes_fetch_of_a_value_that_is_a_future_fails_to_pickle_not_waits(group: Group) -> None:
    # The fetch reaches the owner (on the lane) while the remote() (on the loop's path)
    # still runs: the owner waits for the value, which is a torch future. It is the value,
    # not something to wait for, and cannot be sent (torch's behaviour): an error, no hang.
    def run() -> type[BaseException] | None:
        rref = asyncrpc.remote("w1", fns.torch_future_after, args=(0.5,))
        try:
            rref.to_here(timeout=20)
        except Exception as exc:
            return type(exc)
        return None

    error = _in_thread(run)
    assert error is asyncrpc.SerializationError
