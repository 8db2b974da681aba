"""Start and stop worker processes on 127.0.0.1 for tests and benchmarks (layer L4).

Processes are only ever stopped by the PID we started them with; every launch has a
bounded lifetime through the caller's ``stop_workers`` in a ``finally``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrpc.testing.prefork import PreforkedProcess, Preforker, PreforkError

_log = logging.getLogger(__name__)

__all__ = [
    "WorkerProcess",
    "free_port",
    "preforker",
    "repo_env",
    "spawn_worker",
    "start_module",
    "stop_workers",
    "use_preforker",
]

_preforker: Preforker | None = None


def use_preforker(server: Preforker | None) -> None:
    """Start later processes from ``server`` where it can run them (None: fresh ones).

    The test session sets one (tests/conftest.py): each worker then costs a fork instead
    of an interpreter importing torch. The benchmark never does.
    """
    global _preforker
    _preforker = server


def preforker() -> Preforker | None:
    """The prefork server set by ``use_preforker``, if any."""
    return _preforker


REPO_ROOT = Path(__file__).resolve().parents[2]  # where ``python -m asyncrpc...`` runs


def repo_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, then
    ``extra``: what every started worker and scenario process gets. The prefork server
    is started with it too, so a child forks only where this stays the same
    (``Preforker.can_run`` compares ``PYTHONPATH``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def start_module(
    module: str,
    args: Sequence[str],
    *,
    env: dict[str, str],
    cwd: Path,
    prefix: Sequence[str] = (),
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    text: bool = False,
) -> subprocess.Popen[Any] | PreforkedProcess:
    """``python -m module *args``: forked from the prefork server where it can run it,
    else a fresh interpreter (always one behind a ``prefix``, which must exec it)."""
    if _preforker is not None and not prefix and _preforker.can_run(env):
        try:
            return _preforker.popen(
                module, args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                text=text,
            )  # fmt: skip
        except PreforkError as exc:  # the server is gone: fresh interpreters from now on
            _log.warning("starting %s as a fresh interpreter: %s", module, exc)
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text,
    )  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host`` (the OS picks it).

    Another process may take it before you bind it: retry on "address already in use",
    or let a worker bind port 0 itself (``listen_port=0``) where it can.

    Args:
        host: the address to bind on.

    Returns:
        The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    """A worker process we started, and where its output goes."""

    name: str
    rank: int
    process: subprocess.Popen[bytes] | PreforkedProcess
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def log(self) -> str:
        """What the worker wrote to stdout and stderr so far ("" if unreadable)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL this worker (by the PID we started) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def spawn_worker(
    name: str,
    rank: int,
    world_size: int,
    init_method: str,
    *,
    log_dir: Path,
    mode: str = "sync",
    rpc_timeout: float = 60.0,
    shutdown_timeout: float = 600.0,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> WorkerProcess:
    """Start ``python -m asyncrpc.testing.worker`` as rank ``rank`` of a group.

    The worker joins, serves until every worker calls shutdown, then exits 0 (or 3 when
    the shutdown failed).

    Args:
        name: the worker's name.
        rank: its rank.
        world_size: the group's size.
        init_method: the rendezvous URL (``tcp://127.0.0.1:PORT``, ``file://...``).
        log_dir: where its output goes (``<name>.log``).
        mode: "sync" (``init_rpc``) or "async" (``init_rpc_async`` on its own loop).
        rpc_timeout: its default call timeout, in seconds.
        shutdown_timeout: its bound on the graceful shutdown, in seconds.
        extra_args: more command-line options of ``asyncrpc.testing.worker``
            (``--threads``, ``--heartbeat-timeout``, ``--listen-host``...).
        env: variables added to this process's environment for it.
        prefix: what goes before the command, for a launcher that execs it in place
            (``ip netns exec NS``: the PID stays the worker's).

    Returns:
        The started ``WorkerProcess``; stop it with ``stop_workers`` or ``kill``.

    Raises:
        OSError: the process could not be started.
    """
    log_path = log_dir / f"{name}.log"
    full_env = repo_env(env)
    args = [
        "--name", name, "--rank", str(rank), "--world-size", str(world_size),
        "--init-method", init_method, "--mode", mode,
        "--rpc-timeout", str(rpc_timeout), "--shutdown-timeout", str(shutdown_timeout),
        *extra_args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = start_module(
            "asyncrpc.testing.worker", args, env=full_env, cwd=REPO_ROOT, prefix=prefix,
            stdout=log.fileno(), stderr=subprocess.STDOUT,
        )  # fmt: skip
    return WorkerProcess(name, rank, process, log_path)


def stop_workers(workers: Sequence[WorkerProcess], timeout: float = 30.0) -> list[int | None]:
    """Wait up to ``timeout`` for the workers to exit, then SIGKILL the rest (by PID).

    Args:
        workers: the workers, as ``spawn_worker`` returned them.
        timeout: seconds to wait for all of them together.

    Returns:
        Each worker's exit code (None only if it could not be reaped).
    """
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for worker in workers:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            codes.append(worker.process.wait(remaining))
        except subprocess.TimeoutExpired:
            worker.kill()
            codes.append(worker.process.returncode)
    return codes
