"""The prefork server (``asyncrpc.testing.prefork``) starts processes that behave as fresh
``python -m`` ones: arguments, environment, working directory, stdio, exit codes, thread
and ``atexit`` handling at exit, its own random stream; and the launchers fall back to a
fresh interpreter where a fork cannot honour the environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrpc.testing import launcher
from asyncrpc.testing.prefork import PreforkedProcess, Preforker, PreforkError

ROOT = launcher.REPO_ROOT
PROBE = "tests.integration.prefork_probe"


def _env(**extra: str) -> dict[str, str]:
    return launcher.repo_env(extra)


@pytest.fixture(scope="module")
def server() -> Iterator[Preforker]:
    preforker = Preforker(["json"], cwd=ROOT, env=_env())
    try:
        yield preforker
    finally:
        preforker.close()


def _run(
    server: Preforker, *args: str, cwd: Path = ROOT, stdin: int | None = None, **env: str
) -> PreforkedProcess:
    return server.popen(
        PROBE, args, env=_env(**env), cwd=cwd, stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(process: PreforkedProcess) -> tuple[int, dict[str, object], list[str]]:
    assert process.stdout is not None
    lines = process.stdout.read().splitlines()
    code = process.wait(30)
    process.stdout.close()
    return code, json.loads(lines[0]), lines[1:]


def test_child_runs_the_module_as_python_m_would(server: Preforker, tmp_path: Path) -> None:
    code, seen, rest = _finish(_run(server, "exit", "0", cwd=tmp_path, PROBE="yes"))
    assert code == 0, rest
    assert seen["name"] == "__main__"
    assert seen["argv"] == ["exit", "0"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["probe"] == "yes"
    assert seen["ppid"] != os.getpid()  # the server's child, not ours


def test_exit_codes_are_those_of_a_fresh_interpreter(server: Preforker) -> None:
    assert _finish(_run(server, "exit", "3"))[0] == 3
    code, _, rest = _finish(_run(server, "raise"))
    assert code == 1
    assert any("LookupError: the probe raised" in line for line in rest), rest
    sleeper = _run(server, "sleep", "60")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    assert sleeper.poll() is None
    sleeper.kill()
    assert _finish(sleeper)[0] == -signal.SIGKILL
    sleeper.send_signal(signal.SIGTERM)  # reaped already: nothing is signalled
    assert sleeper.poll() == -signal.SIGKILL


def test_exit_joins_threads_runs_atexit_and_flushes(server: Preforker) -> None:
    code, _, rest = _finish(_run(server, "thread", "atexit"))
    assert code == 0
    assert rest == ["thread done", "atexit ran"]


def test_pipes_both_ways(server: Preforker) -> None:
    process = _run(server, "echo", stdin=subprocess.PIPE)
    assert process.stdin is not None
    process.stdin.write("one\ntwo\n")
    process.stdin.close()
    code, _, rest = _finish(process)
    assert code == 0
    assert rest == ["echo one", "echo two"]


def test_each_child_has_its_own_random_stream(server: Preforker) -> None:
    firsts = {_finish(_run(server))[1]["random"] for _ in range(3)}
    assert len(firsts) == 3


def test_environment_read_at_start_is_not_forked(server: Preforker) -> None:
    assert server.can_run(_env(PROBE="anything"))
    assert not server.can_run(_env(OMP_NUM_THREADS="7"))
    assert not server.can_run(_env(PYTHONPATH="/elsewhere"))
    assert not server.can_run(_env(TORCH_SHOW_CPP_STACKTRACES="1"))


def test_launcher_forks_where_it_can_and_starts_fresh_where_not(server: Preforker) -> None:
    before = launcher.preforker()
    launcher.use_preforker(server)
    try:
        forked = launcher.start_module(
            PROBE, [], env=_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        fresh = launcher.start_module(
            PROBE, [], env=_env(OMP_NUM_THREADS="1"), cwd=ROOT, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    finally:
        launcher.use_preforker(before)
    assert isinstance(forked, PreforkedProcess)
    assert isinstance(fresh, subprocess.Popen)
    for process in (forked, fresh):
        assert process.stdout is not None
        seen = json.loads(process.stdout.readline())
        assert seen["name"] == "__main__"
        assert process.wait(30) == 0
        process.stdout.close()


def test_a_server_that_cannot_start_says_so() -> None:
    broken = Preforker(["no_such_module_anywhere"], cwd=ROOT, env=_env())
    try:
        with pytest.raises(PreforkError, match="no_such_module_anywhere"):
            broken.popen(PROBE, [], env=_env(), cwd=ROOT)
        assert not broken.can_run(_env())  # the launcher then starts fresh interpreters
    finally:
        broken.close()


def test_children_outlive_a_closed_server() -> None:
    preforker = Preforker(["json"], cwd=ROOT, env=_env())
    process = _run(preforker, "sleep", "60")
    preforker.close()
    try:
        os.kill(process.pid, 0)  # still running: its starter stops it, as with Popen
    finally:
        os.kill(process.pid, signal.SIGKILL)  # the PID we started, reaped by no one yet
        assert process.stdout is not None
        process.stdout.close()
    with pytest.raises(PreforkError, match="closed the connection"):
        process.wait(30)  # nobody is left to say how it ended


def test_launcher_starts_fresh_interpreters_once_the_server_died() -> None:
    preforker = Preforker(["json"], cwd=ROOT, env=_env())
    before = launcher.preforker()
    launcher.use_preforker(preforker)
    try:
        forked = launcher.start_module(PROBE, [], env=_env(), cwd=ROOT, stdout=subprocess.PIPE)
        assert isinstance(forked, PreforkedProcess)
        assert forked.wait(30) == 0
        server = preforker._server  # the process we started: killed by its PID
        assert server is not None
        server.kill()
        server.wait(10)
        fresh = launcher.start_module(PROBE, [], env=_env(), cwd=ROOT, stdout=subprocess.PIPE)
        assert isinstance(fresh, subprocess.Popen)
        assert fresh.wait(60) == 0
        assert not preforker.can_run(_env())
    finally:
        launcher.use_preforker(before)
        preforker.close()
    for process in (forked, fresh):
        assert process.stdout is not None
        process.stdout.close()
