"""Dynamic groups for real: members join (and leave) while the others serve.

Each member is a ``dynamic_member`` scenario process driven line by line, so the test fixes who
joins when and who calls whom. Every process is killed in ``finally``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from asyncrpc.testing import free_port
from tests import scenarios

pytestmark = pytest.mark.timeout(90)


class Member:
    """A running member: ``do`` sends one command and returns its outcome."""

    def __init__(self, proc: scenarios.ScenarioProcess) -> None:
        self.proc = proc

    def do(self, command: str, timeout: float = 30.0) -> dict[str, Any]:
        self.proc.send(command)
        line = self.proc.wait_line(f"DONE {command.split(maxsplit=1)[0]}", timeout)
        outcome: dict[str, Any] = json.loads(line.split(" ", 2)[2])
        return outcome

    def value(self, command: str) -> Any:
        outcome = self.do(command)
        assert outcome["error"] is None, (command, outcome, self.proc.text())
        return outcome["value"]

    def shutdown(self, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
        self.proc.send("shutdown")
        return self.proc.result(timeout)


@contextmanager
def _group() -> Iterator[tuple[str, list[scenarios.ScenarioProcess]]]:
    """A fresh TCP store address; every process started for it is killed on exit."""
    procs: list[scenarios.ScenarioProcess] = []
    try:
        yield f"tcp://127.0.0.1:{free_port()}", procs
    finally:
        for proc in procs:
            proc.kill()


def _join(
    init_method: str, procs: list[scenarios.ScenarioProcess], name: str, rank: int, *extra: str
) -> Member:
    args = ["--init-method", init_method, "--name", name, "--rank", str(rank), *extra]
    proc = scenarios.start("dynamic_member", *args)
    procs.append(proc)
    proc.wait_line("JOINED", 30.0)
    return Member(proc)


def _shutdown_all(members: list[Member]) -> list[tuple[int, dict[str, Any]]]:
    for member in members:  # all at once: each leaves on its own
        member.proc.send("shutdown")
    return [member.proc.result(30.0) for member in members]


def test_dynamic_members_that_joined_early_and_late_call_each_other_and_share_rrefs() -> None:
    with _group() as (init, procs):
        a = _join(init, procs, "a", 0)
        b = _join(init, procs, "b", 1)  # a is serving already
        assert a.value("call b") == "b"  # existing -> newcomer: a looks b up
        assert b.value("call a") == "a"  # newcomer -> existing: known since its join
        c = _join(init, procs, "c", 2)
        assert a.value("acall c") == "c"  # looked up off the loop, from a coroutine
        assert c.value("remote a") == {"owner": "a", "value": [2.0, 2.0]}
        assert a.value("remote c") == {"owner": "c", "value": [2.0, 2.0]}
        # b never met c: it gets a fork of c's RRef from a and fetches it from c.
        assert a.value("pass b 0") == [2.0, 2.0]
        assert b.value("infos") == ["a", "b", "c"]
        results = _shutdown_all([a, b, c])
        assert [code for code, _ in results] == [0, 0, 0], results
        assert all(obs["shutdown"]["error"] is None for _, obs in results), results


def test_dynamic_member_leaves_alone_and_a_newcomer_joins_after_it() -> None:
    with _group() as (init, procs):
        a = _join(init, procs, "a", 0)
        a.value("watch")  # membership events on a, from now on
        b = _join(init, procs, "b", 1)
        assert a.value("call b") == "b"
        started = time.monotonic()
        code, obs = b.shutdown()
        # No barrier: b leaves while a runs on (a static member would wait out its timeout).
        assert (code, obs["shutdown"]["error"]) == (0, None), obs
        assert time.monotonic() - started < 10.0
        gone = a.do("call b")
        assert gone["error"] is not None, gone
        assert gone["error"]["type"] == "PeerLostError", gone
        assert a.value("infos") == ["a"]
        d = _join(init, procs, "d", 2)
        assert d.value("call a") == "a"
        assert a.value("call d") == "d"
        assert a.value("infos") == ["a", "d"]
        # a met b (joined), b shut down (left, said goodbye), then d joined and called a.
        assert a.value("events 3") == [
            ["joined", "b", ""], ["left", "b", "goodbye"], ["joined", "d", ""],
        ]  # fmt: skip
        results = _shutdown_all([d, a])
        assert [code for code, _ in results] == [0, 0], results


def test_dynamic_owner_leaving_waits_for_the_member_holding_its_rref() -> None:
    with _group() as (init, procs):
        a = _join(init, procs, "a", 0)
        c = _join(init, procs, "c", 1)
        assert a.value("remote c") == {"owner": "c", "value": [2.0, 2.0]}
        c.proc.send("leave")  # c leaves while a, which holds c's RRef, runs on
        c.proc.wait_line("LEAVING", 30.0)  # c is inside its shutdown
        assert a.value("fetch 0") == [2.0, 2.0]  # the value is still served
        dropped_at = time.monotonic()  # one clock for all processes here (Linux)
        a.value("drop 0")
        code, obs = c.proc.result(30.0)
        assert (code, obs["shutdown"]["error"]) == (0, None), obs
        assert obs["ended_at"] > dropped_at, obs  # it waited for the release
        assert a.do("call c")["error"]["type"] == "PeerLostError"
        assert a.shutdown()[0] == 0


def test_static_member_is_refused_by_a_dynamic_group() -> None:
    with _group() as (init, procs):
        a = _join(init, procs, "a", 0)
        static = scenarios.start(
            "member", "--init-method", init, "--name", "s", "--rank", "1", "--world-size", "2",
            "--rpc-timeout", "10",
        )  # fmt: skip
        procs.append(static)
        code, obs = static.result(30.0)
        assert code == 1, obs
        error = obs["init"]["error"]
        assert error["type"] == "MixedGroupError", error
        assert "RuntimeError" in error["mro"], error
        assert "mixes statically and dynamically initialized members" in error["message"]
        assert a.value("infos") == ["a"]  # the group is unharmed
        assert a.shutdown()[0] == 0


def test_dynamic_newcomer_without_the_group_key_is_refused() -> None:
    with _group() as (init, procs):
        a = _join(init, procs, "a", 0, "--auth-key", "the-group-key")
        stranger = _join(init, procs, "x", 1, "--auth-key", "another-key")
        refused = stranger.do("call a")
        assert refused["error"] is not None, refused
        assert refused["error"]["type"] == "PeerUnavailableError", refused
        good = _join(init, procs, "g", 2, "--auth-key", "the-group-key")
        assert good.value("call a") == "a"
        assert a.value("call g") == "g"
        assert refused["elapsed"] < 10.0
        results = _shutdown_all([good, stranger, a])
        assert [code for code, _ in results] == [0, 0, 0], results
