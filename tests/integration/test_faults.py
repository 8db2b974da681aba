"""Faults between real processes: a peer SIGKILLed mid-call, and raw sockets sending garbage.

The kill scenario needs a group of its own (``scenarios.kill_peer`` is its driver); the
malformed-frame tests poke the shared group's workers, which must survive them.
"""

from __future__ import annotations

import datetime
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

import asyncrpc
from asyncrpc.protocol import auth
from asyncrpc.protocol.address import PeerAddress
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import MAGIC, PROTOCOL_VERSION, Frame, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import (
    CallMode,
    Hello,
    HelloReply,
    Refusal,
    Reply,
    Request,
    decode_message,
)
from asyncrpc.runtime.group.rendezvous import StoreGroup
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group
from tests.integration.rawpeer import closed_by_peer, published_address

pytestmark = pytest.mark.timeout(90)

_PRELUDE = struct.Struct("!4sBBHIIQ")  # the wire prelude (asyncrpc/protocol/wire/frame.py)


# -- a peer is SIGKILLed in the middle of a call --------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["graceful", "not-graceful"])
def killed_peer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run ``kill_peer`` once per shutdown mode: kill w1 (by the PID we started) once its
    call runs on it; yield the scenario's observations."""
    graceful: bool = request.param
    tmp_path = tmp_path_factory.mktemp("kill")
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(f"w{r}", r, 3, init, log_dir=tmp_path, rpc_timeout=10.0,
                     shutdown_timeout=10.0)
        for r in (1, 2)
    ]  # fmt: skip
    driver = scenarios.start("kill_peer", "--init-method", init, "--graceful", str(int(graceful)))
    try:
        driver.wait_line("STARTED", 30.0)
        killed_at = time.monotonic()
        workers[0].kill()
        driver.send("KILLED")
        code, obs = driver.result(30.0)
    finally:
        driver.kill()
        codes = stop_workers(workers, timeout=15.0)
    obs.update(graceful=graceful, code=code, killed_at=killed_at, w1_pid=workers[0].pid)
    obs.update(worker_codes=codes, logs=driver.text() + "".join(w.log() for w in workers))
    return obs


def test_Agent_pending_call_to_killed_peer_fails_within_a_second(
    killed_peer: dict[str, Any],
) -> None:
    obs = killed_peer
    assert obs["code"] == 0, obs["logs"]
    assert obs["running_on_w1"] is True
    assert obs["stdin"] == "KILLED"
    error = obs["pending"]["error"]
    assert error is not None, obs["pending"]
    assert error["type"] == "PeerLostError"
    assert "ConnectionError" in error["mro"]
    assert error["worker"] == "w1"
    assert obs["pending_failed_at"] is not None
    assert obs["pending_failed_at"] - obs["killed_at"] < 1.0


def test_on_peer_lost_tells_the_program_once_about_the_killed_peer(
    killed_peer: dict[str, Any],
) -> None:
    obs = killed_peer
    ((worker, reason),) = obs["losses"]  # once, and only w1 (w2 lives on)
    assert worker == "w1"
    assert reason
    assert obs["loss_told_after"] is not None
    assert obs["loss_told_after"] < 1.0  # after the pending call failed, not a timeout later
    assert obs["stopped_watcher"] == []
    print(f"on_peer_lost ran {obs['loss_told_after'] * 1e3:.1f} ms after the pending call failed")


def test_Agent_later_call_to_killed_peer_fails_fast(killed_peer: dict[str, Any]) -> None:
    later = killed_peer["later_w1"]
    assert later["error"] is not None, later
    assert later["error"]["type"] == "PeerLostError"
    assert later["error"]["worker"] == "w1"
    assert later["elapsed"] < 0.5
    assert killed_peer["debug_lost_peers"] == ["w1"]


def test_failed_calls_to_a_lost_peer_keep_none_of_the_callers_frames(
    killed_peer: dict[str, Any],
) -> None:
    # The lost peer's error is kept for good; raising that one instance in each caller
    # would put every caller's frame (and its locals) into its traceback for good.
    assert killed_peer["locals_kept_after_failed_calls"] == [False, False]


def test_Agent_other_peers_keep_working_after_a_kill(killed_peer: dict[str, Any]) -> None:
    assert killed_peer["w2_in_flight"] == {
        "value": "slept", "error": None, "elapsed": killed_peer["w2_in_flight"]["elapsed"]
    }  # fmt: skip
    assert killed_peer["later_w2"]["value"] == 3


def test_shutdown_returns_despite_a_dead_peer(killed_peer: dict[str, Any]) -> None:
    obs = killed_peer
    result = obs["shutdown"]
    # Graceful: the survivors leave the dead w1 out of the barriers and finish together
    # (torch hangs forever here); the driver logs a warning naming w1.
    assert result["error"] is None, result
    assert result["elapsed"] < (5.0 if obs["graceful"] else 2.0)
    if obs["graceful"]:
        assert "worker(s) 'w1' died before shutdown" in obs["logs"]
    assert obs["not_initialized_after"]["type"] == "NotInitializedError"
    # w1 was killed by us; w2 exits on its own, its shutdown done (graceful) or failed
    # (the driver left without waiting for it).
    assert obs["worker_codes"][0] == -signal.SIGKILL
    assert obs["worker_codes"][1] not in (None, -signal.SIGKILL), obs["logs"]
    if obs["graceful"]:
        assert obs["worker_codes"][1] == 0, obs["logs"]


# -- raw sockets sending garbage to a worker of the shared group ----------------------------


def _listening_port(rank: int) -> int:
    # The port the worker published at rendezvous: the one every peer dials.
    return published_address(rank).port


def _protocol_errors(worker: str) -> int:
    return int(asyncrpc.rpc_sync(worker, fns.metrics)["protocol_errors"])


def _wait_protocol_errors(worker: str, at_least: int, timeout: float = 2.0) -> int:
    deadline = time.monotonic() + timeout
    count = _protocol_errors(worker)
    while count < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
        count = _protocol_errors(worker)
    return count


def _request_before_hello() -> bytes:
    request = Request(1, 0.0, CallMode.CALL, "tests.integration.remote_fns.noop")
    return b"".join(bytes(p) for p in encode_frame(request.to_fields(), b"not a pickle"))


def test_Connection_bad_magic_is_closed_and_worker_keeps_serving(group: Group) -> None:
    closed, got = closed_by_peer(_listening_port(1), b"GARBAGE!" * 8, 5.0)
    assert closed
    assert got == b""
    assert asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)) == 3


def test_Connection_oversized_frame_is_closed_before_allocating(group: Group) -> None:
    prelude = _PRELUDE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 16, 0, 1 << 40)
    started = time.monotonic()
    closed, got = closed_by_peer(_listening_port(3), prelude + b"\x90" * 16, 5.0)
    assert closed
    assert got == b""
    assert time.monotonic() - started < 5.0
    assert asyncrpc.rpc_sync("w3", fns.add, args=(2, 3)) == 5
    assert asyncrpc.rpc_sync("w3", fns.echo, args=(b"x" * 100_000,)) == b"x" * 100_000


def test_Connection_message_before_hello_is_closed_and_counted(group: Group) -> None:
    before = _protocol_errors("w2")
    closed, got = closed_by_peer(_listening_port(2), _request_before_hello(), 5.0)
    assert closed
    assert got == b""
    assert _wait_protocol_errors("w2", before + 1) == before + 1
    assert asyncrpc.rpc_sync("w2", fns.async_add, args=(1, 2)) == 3


def test_Connection_frame_level_errors_are_counted(group: Group) -> None:
    before = _protocol_errors("w1")
    closed_by_peer(_listening_port(1), b"GARBAGE!" * 8, 5.0)
    prelude = _PRELUDE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 16, 0, 1 << 40)
    closed_by_peer(_listening_port(1), prelude, 5.0)
    assert _wait_protocol_errors("w1", before + 2) == before + 2


# -- a fake peer (raw socket) that a real worker dials ---------------------------------------


class _FakePeer:
    """Our side of a connection a real worker dialled: read frames, write frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.serializer = Serializer()
        self.decoder = FrameDecoder(allocate=self.serializer.allocate)
        self.frames: list[Frame] = []

    def next_frame(self, timeout: float) -> Frame | None:
        """The next frame, or None at EOF. Raises RuntimeError when nothing comes in time."""
        self.sock.settimeout(timeout)
        while not self.frames:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            except TimeoutError:
                raise RuntimeError("the worker sent nothing and kept the connection") from None
            if not data:
                return None
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def frame(self, message: Any, value: object = None) -> bytes:
        payload, segments, _, _ = (
            self.serializer.dumps(value) if value is not None else (b"", [], [], None)
        )
        return b"".join(bytes(p) for p in encode_frame(message.to_fields(), payload, segments))

    def answer_until_reply(self, call_id: int, timeout: float) -> object:
        """Answer the worker's requests (with 0) until it replies to ``call_id``; return
        that reply's value, or ``"closed"`` when the worker closed the connection."""
        deadline = time.monotonic() + timeout
        while (frame := self.next_frame(max(0.1, deadline - time.monotonic()))) is not None:
            message = decode_message(frame.fields)
            if isinstance(message, Request):
                self.sock.sendall(self.frame(Reply(message.call_id), 0))
            elif isinstance(message, Reply) and message.call_id == call_id:
                return self.serializer.loads(frame.payload, frame.segments)
        return "closed"


def test_PeerTable_dialer_accepts_a_request_right_behind_the_hello_reply() -> None:
    import torch.distributed as dist

    store_port = free_port()
    args = ["--init-method", f"tcp://127.0.0.1:{store_port}", "--name", "m0", "--rank", "0"]
    args += ["--world-size", "2", "--call", "fake", "--shutdown-timeout", "2"]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        member = scenarios.start("member", *args)
        try:
            # We are rank 1, "fake": published through the library's own store records.
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1",
                store_port,
                world_size=2,  # counts as a client the store host waits for
                is_master=False,
                timeout=datetime.timedelta(seconds=30),
            )
            group = StoreGroup(store, 1, 2)
            group.enter()
            group.claim_kind()
            group.publish(PeerAddress("fake", 1, "127.0.0.1", listener.getsockname()[1]))
            key, _ = group.pass_gate(30.0)  # the group key, from the trusted store
            # So that m0's start (which returns once every member has joined) and its
            # graceful shutdown do not wait for us.
            group.joined(30.0)
            for tag in ("calls-done", "users-released", "closing", "left"):
                group.arrive(tag)
            listener.settimeout(30.0)
            sock, _ = listener.accept()
            with sock:
                peer = _FakePeer(sock)
                hello = peer.next_frame(10.0)
                message = None if hello is None else decode_message(hello.fields)
                if not isinstance(message, Hello):
                    raise RuntimeError(f"expected a Hello first:\n{member.text()}")
                # We hold the group key (read from the trusted store), so we may answer.
                nonce = auth.new_nonce()
                dialer, me = (message.name, message.rank), ("fake", 1)
                mine = auth.proof(key, auth.ACCEPTOR, message.nonce, nonce, dialer, me)
                reply = HelloReply(PROTOCOL_VERSION, "fake", 1, Refusal.NONE, "", nonce, mine)
                request = Request(77, 0.0, CallMode.CALL, "tests.integration.remote_fns.add")
                sock.sendall(  # both frames in one write: they arrive back to back
                    peer.frame(reply) + peer.frame(request, (fns.add, (2, 3), {}))
                )
                value = peer.answer_until_reply(77, 10.0)
            del store
        finally:
            member.kill()
    assert value == 5, member.text()


def test_a_worker_whose_graceful_shutdown_fails_still_says_goodbye(tmp_path: Path) -> None:
    # w1's shutdown (1 s) runs out while the driver keeps running: w1 leaves anyway, and
    # the driver is told (Goodbye), not left to find a closed listener by redialling.
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=tmp_path, shutdown_timeout=1.0)
    driver = scenarios.start("failed_shutdown", "--init-method", init)
    try:
        code, obs = driver.result(60.0)
        assert code == 0, driver.text()
    finally:
        driver.kill()
        stop_workers([worker], timeout=15)
    assert obs["w1_answers"] == 3
    assert obs["lost_without_a_call"] is True
    error = obs["call_after"]["error"]
    assert error is not None, obs
    assert error["type"] == "PeerLostError"
    assert "shut down" in error["message"]
    assert obs["shutdown"]["error"] is None
    assert obs["losses"] == []  # it left: on_peer_lost is for losses only
    assert "shutdown failed" in (tmp_path / "w1.log").read_text()


def test_a_worker_whose_program_ends_without_shutdown_is_named_so_on_both_sides() -> None:
    # The leaver's program returns without shutdown(), its worker still running: it warns
    # at exit, and the stayer's errors say the leaver closed without a Goodbye, a hint of
    # the forgotten shutdown(). The stayer never says "the next call reconnects": the
    # leaver is gone, as its refused redial proves.
    init = f"tcp://127.0.0.1:{free_port()}"
    common = ["--init-method", init, "--rpc-timeout", "20", "--role"]
    stayer = scenarios.start("forgets_shutdown", *common, "stayer")
    leaver = scenarios.start("forgets_shutdown", *common, "leaver")
    try:
        leaver.wait_line("STARTED", 30.0)
        stayer.wait_line("STARTED", 30.0)
        leaver.send("EXIT")
        code, _ = leaver.result(30.0)
        assert code == 0, leaver.text()
        code, obs = stayer.result(30.0)
        assert code == 0, stayer.text()
    finally:
        stayer.kill()
        leaver.kill()
    assert "asyncrpc worker 'leaver' was not shut down; call asyncrpc.shutdown()" in leaver.text()
    assert obs["running"], obs
    assert obs["declared_lost"], obs
    pending, later = obs["pending"]["error"], obs["later"]["error"]
    assert pending["type"] == later["type"] == "PeerLostError", obs
    assert "without a Goodbye" in pending["message"], pending
    assert "without calling asyncrpc.shutdown()" in pending["message"], pending
    blocking = obs["pending_blocking"]["error"]  # on a lane: the same hint
    assert blocking["type"] == "PeerLostError", obs
    assert "without calling asyncrpc.shutdown()" in blocking["message"], blocking
    assert "its process has ended" in later["message"], later
    assert "without calling asyncrpc.shutdown()" in later["message"], later
    assert obs["shutdown"]["error"] is None, obs
    assert "the next call reconnects" not in stayer.text()
    assert scenarios.cpp_log_lines(stayer.text() + leaver.text()) == []
