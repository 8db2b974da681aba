"""Benchmark child processes and the groups of them that make up one system under test.

Part of ``asyncrpc.bench``. Every process is started here, driven over its stdin/stdout
control channel with a timeout on every wait, and only ever killed by the PID we started
it with. A group can be frozen (SIGSTOP) while another system is measured, because idle
TensorPipe processes spin a core and would otherwise slow whatever runs beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from asyncrpc.bench.child import MARK
from asyncrpc.bench.config import MIB, RPC_SYSTEMS, BenchConfig
from asyncrpc.testing import free_port

__all__ = ["ChildError", "ChildProcess", "SystemGroup", "start_group"]

_ROOT = Path(__file__).resolve().parents[2]
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ChildError(Exception):
    """A benchmark process failed, exited or did not answer in time."""


class ChildProcess:
    """One ``python -m asyncrpc.bench.child`` process and its control channel."""

    def __init__(self, name: str, args: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "asyncrpc.bench.child", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=_ROOT,
            )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
        self._answers.put(None)  # end of output: the process is gone or going

    def send(self, message: dict[str, Any]) -> None:
        """Write one command line.

        Raises:
            ChildError: the process has exited.
        """
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ChildError(f"{self.name} is gone ({exc})\n{self.log_tail()}") from exc

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next answer, waiting at most ``timeout`` seconds.

        Raises:
            ChildError: no answer in time, or the process exited.
        """
        answer = self.try_receive(timeout)
        if answer is None:
            raise ChildError(
                f"{self.name} did not answer within {timeout:.0f} s\n{self.log_tail()}"
            )
        return answer

    def try_receive(self, timeout: float) -> dict[str, Any] | None:
        """The next answer, or None when none came within ``timeout`` seconds.

        Raises:
            ChildError: the process exited.
        """
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            return None
        if answer is None:
            self._answers.put(None)  # stays at its end for later readers
            code = self.process.wait(5)
            raise ChildError(f"{self.name} exited with code {code}\n{self.log_tail()}")
        return answer

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL (by our PID) and reap; works on a stopped process too. Closes the pipes."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the kernel owes us this
            self.process.wait(10)
        self._reader.join(5)  # the pipe is at its end once the process is gone
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not self._reader.is_alive():
                with contextlib.suppress(OSError):
                    stream.close()

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of all the process's threads so far (Linux only)."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = "\n".join("    " + line for line in text[-lines:])
        return f"  last lines of {self.log_path}:\n{tail}" if tail else ""


class SystemGroup:
    """The processes of one system: a server, a client and (for ``ps`` and
    ``dist-autograd``) a trainer; dist-autograd's client drives the server and trainer."""

    def __init__(self, system: str, children: dict[str, ChildProcess]) -> None:
        self.system = system
        self.children = children
        self.frozen = False

    def drivers(self, kind: str) -> list[ChildProcess]:
        """The processes that run items of ``kind`` (both trainers for ``ps``)."""
        roles = ("client", "trainer") if kind == "ps" else ("client",)
        return [self.children[r] for r in roles if r in self.children]

    def freeze(self) -> None:
        for child in self.children.values():
            child.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        for child in self.children.values():
            child.signal(signal.SIGCONT)
        self.frozen = False

    def cpu_seconds(self) -> float | None:
        values = [c.cpu_seconds() for c in self.children.values()]
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

    def run(
        self,
        kind: str,
        items: list[dict[str, Any]],
        duration: float,
        timeout: float,
        warmup: float = 0.0,
    ) -> list[dict[str, Any]]:
        """Send one ``run`` command to every driver at once; return their answers. Each item
        runs ``warmup`` seconds untimed, then ``duration`` seconds timed.

        Raises:
            ChildError: a driver failed or timed out.
        """
        drivers = self.drivers(kind)
        # Every process of the group, so that a driver can read what each item cost each.
        pids = {role: child.pid for role, child in self.children.items()}
        for child in drivers:
            command = {"op": "run", "items": items, "duration": duration, "warmup": warmup}
            child.send({**command, "pids": pids})
        deadline = time.monotonic() + timeout
        return [c.receive(max(0.1, deadline - time.monotonic()))["results"] for c in drivers]

    def close(self, timeout: float = 30.0) -> None:
        """Ask every process to quit, wait up to ``timeout``, then kill what is left."""
        self.thaw()
        for child in self.children.values():
            with contextlib.suppress(ChildError):
                child.send({"op": "quit"})
        deadline = time.monotonic() + timeout
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            child.kill()


def _spawn(system: str, role: str, log_dir: Path, extra: list[str]) -> ChildProcess:
    return ChildProcess(
        f"{system}/{role}",
        ["--system", system, "--role", role, *extra],
        log_dir / f"{system}-{role}.log",
    )


def _await_ready(children: list[ChildProcess], timeout: float) -> None:
    # Poll them all, so that one dying fails the start at once rather than after the
    # others have waited out the timeout in their rendezvous.
    deadline = time.monotonic() + timeout
    waiting = list(children)
    while waiting:
        for child in list(waiting):
            if child.try_receive(0.05) is not None:
                waiting.remove(child)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(c.name for c in waiting)
            raise ChildError(f"{names} not ready after {timeout:.0f} s\n{waiting[0].log_tail()}")


def start_group(system: str, config: BenchConfig, log_dir: Path) -> SystemGroup:
    """Start ``system``'s processes on 127.0.0.1 and wait until they are ready.

    Raises:
        ChildError: a process failed to start (all of them are killed first).
    """
    children: dict[str, ChildProcess] = {}
    try:
        if system == "floor":
            # Both ends start at once; the client retries until the server listens.
            extra = ["--capacity", str(max((*config.sizes, MIB))), "--port", str(free_port())]
            children = {role: _spawn(system, role, log_dir, extra) for role in ("server", "client")}
        else:
            assert system in RPC_SYSTEMS
            # ps trains from the third process; dist-autograd puts its second layer there.
            third = {"ps", "dist-autograd"} & set(config.workloads)
            roles = ["server", "client"] + (["trainer"] if third else [])
            init = f"tcp://127.0.0.1:{free_port()}"
            for rank, role in enumerate(roles):
                extra = ["--rank", str(rank), "--world-size", str(len(roles))]
                children[role] = _spawn(system, role, log_dir, [*extra, "--init-method", init])
        _await_ready(list(children.values()), config.start_timeout)
    except BaseException:
        for child in children.values():
            child.kill()
        raise
    return SystemGroup(system, children)
