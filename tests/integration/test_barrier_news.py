"""A graceful shutdown's barriers open by ``BarrierOpened`` messages down a tree of real
worker processes on 127.0.0.1 (``group/shutdown.py``): the store is asked nothing while a
worker waits, and a worker SIGKILLed before the barriers does not stop the others."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers

pytestmark = pytest.mark.timeout(180)
_OPENED = re.compile(r"barrier '([a-z-]+)' open: ([a-z ]+)")
_TAGS = ["calls-done", "users-released", "closing"]


def _run(tmp_path: Path, size: int, dies: int | None) -> tuple[list[int | None], list[str]]:
    """Start ``size`` workers that join and shut down at once (rank ``dies`` SIGKILLs
    itself instead); their exit codes and logs."""
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = [
        spawn_worker(
            f"b{r}", r, size, init, log_dir=tmp_path, rpc_timeout=30.0, shutdown_timeout=60.0,
            extra_args=["--threads", "2", "--import", "tests.integration.barrier_fns"],
            env={"BARRIER_DIES": "1" if r == dies else "0"},
        )
        for r in range(size)
    ]  # fmt: skip
    try:
        codes = stop_workers(workers, timeout=120.0)
    finally:
        for worker in workers:
            worker.kill()
    return codes, [w.log() for w in workers]


def _how(log: str) -> dict[str, str]:
    return dict(_OPENED.findall(log))


def test_barrier_news_opens_every_barrier_without_the_store(tmp_path: Path) -> None:
    # Eight workers that never called each other: the tree's connections are their only
    # ones. Each barrier is completed by one worker, and every other one is told by a
    # peer: none had to look in the store.
    codes, logs = _run(tmp_path, 8, dies=None)
    assert codes == [0] * 8, "\n".join(logs)
    opened = [_how(log) for log in logs]
    assert all(sorted(how) == sorted(_TAGS) for how in opened), opened
    for tag in _TAGS:
        ways = [how[tag] for how in opened]
        assert ways.count("completed here") == 1, (tag, opened)
        # The others are told by a peer. On a loaded machine a message may come after
        # the first slice (0.5 s): that worker looks in the store once and finds it open.
        # Most must still be told: with the messages broken, all seven look.
        told = ways.count("told by a peer")
        assert told >= 5, (tag, opened)
        assert ways.count("found open in the store") == 7 - told, (tag, opened)


def test_barrier_news_survivors_finish_when_a_worker_was_killed(tmp_path: Path) -> None:
    # Rank 1 (a child of the root: it would pass the news to ranks 3 and 4) joins, then
    # is SIGKILLed before the first barrier. The survivors find it dead (a refused
    # probe), count it, and every barrier opens for all of them: its children are told
    # by whoever knows it dead, or look in the store after a slice.
    codes, logs = _run(tmp_path, 6, dies=1)
    assert codes[1] == -signal.SIGKILL
    survivors = [r for r in range(6) if r != 1]
    assert [codes[r] for r in survivors] == [0] * 5, "\n".join(logs)
    for rank in survivors:
        assert sorted(_how(logs[rank])) == sorted(_TAGS), logs[rank]
        assert "'b1' died before shutdown" in logs[rank], logs[rank]
    for tag in _TAGS:
        assert sum(_how(logs[r])[tag] == "completed here" for r in survivors) == 1, tag
    print({r: _how(logs[r]) for r in survivors})
