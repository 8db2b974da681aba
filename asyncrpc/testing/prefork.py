"""Start ``python -m MODULE ...`` processes by forking a server that imported torch once
(layer L4, tests and tools only).

Why: a fresh ``python -c "import torch, asyncrpc"`` costs about 2 s of CPU on a 2-core
machine, and the integration tests start hundreds of worker and scenario processes. The
server imports the heavy modules once, while it has no thread of its own running, then
forks one child per request. The child takes the caller's stdin/stdout/stderr (passed as
file descriptors over a Unix socket), environment and working directory, and runs the
module as ``__main__`` the way ``python -m`` does, then exits as an interpreter would:
non-daemon threads joined, ``atexit`` handlers run, streams flushed.

What a fork cannot give, the caller must not ask of it: anything read from the
environment while the preloaded modules were imported (``OMP_NUM_THREADS``, a
``PYTHONPATH`` that hides an installed package...) keeps the server's value. The launcher
falls back to a fresh interpreter where such a variable is asked for
(``Preforker.can_run``).

The child is the server's child, not the caller's: ``PreforkedProcess`` gives the
``subprocess.Popen`` methods the launchers use (``pid``, ``poll``, ``wait``, ``kill``,
``returncode``, ``stdin``, ``stdout``), and the server reports each child's exit status
over that child's connection. A signal the caller sends through ``send_signal`` goes
through the server, which only signals a child it has not reaped (no PID reuse).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["PreforkError", "PreforkedProcess", "Preforker"]

# The wire between a caller and the server (prefork_server.py uses these too): a request's
# length, the child's PID, and a 4-byte int each way (the child's exit code; a signal).
REQUEST_LENGTH = struct.Struct(">I")
CHILD_PID = struct.Struct(">q")
STATUS = struct.Struct(">i")
_START_TIMEOUT = 120.0

# Environment variables read at import time by the preloaded modules, or by the
# interpreter at start-up: a child cannot honour a value that differs from the server's.
_READ_AT_START = (
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
    "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONDEVMODE",
    "PYTHONMALLOC", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC", "PYTHONIOENCODING",
    "PYTHONUTF8", "LD_PRELOAD", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
_READ_AT_START_PREFIXES = ("TORCH_", "KMP_", "GOMP_", "MKL_", "PYTORCH_")


class PreforkError(RuntimeError):
    """The prefork server could not be started or did not answer a request."""


class PreforkedProcess:
    """A child of the prefork server, with the ``subprocess.Popen`` methods tests use."""

    def __init__(
        self,
        conn: socket.socket,
        pid: int,
        args: list[str],
        stdin: IO[Any] | None,
        stdout: IO[Any] | None,
    ) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def _read_status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        with selectors.DefaultSelector() as sel:
            sel.register(self._conn, selectors.EVENT_READ)
            if not sel.select(timeout):
                return
        # The server sends the status in one piece once the child is reaped; an EOF
        # without it means the server died, which the caller must hear about.
        self._conn.settimeout(None)
        try:
            (self.returncode,) = STATUS.unpack(_recv_exact(self._conn, STATUS.size))
        finally:
            self._conn.close()

    def poll(self) -> int | None:
        """The exit code if the child has exited (``-N`` for signal N), else None."""
        self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child, through the server, unless it has exited already."""
        with contextlib.suppress(OSError):
            if self.poll() is None:
                self._conn.sendall(STATUS.pack(int(sig)))

    def kill(self) -> None:
        """SIGKILL the child (through the server: never a reused PID)."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the child."""
        self.send_signal(signal.SIGTERM)


class Preforker:
    """A prefork server, started on first use and stopped by ``close``.

    Args:
        preload: modules the server imports before it forks anything.
        cwd: the server's working directory (``sys.path[0]`` of its children).
        env: the server's environment (default: this process's).
    """

    def __init__(
        self,
        preload: Sequence[str],
        *,
        cwd: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._preload = list(preload)
        self._cwd = str(cwd)
        self._env = dict(os.environ if env is None else env)
        self._server: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._path = ""
        self._failed: str | None = None

    def can_run(self, env: Mapping[str, str]) -> bool:
        """Whether a child with environment ``env`` runs as a fresh interpreter would:
        no variable read at start-up differs from the server's, and the server works."""
        if self._failed is not None:
            return False
        for key in set(env) | set(self._env):
            read_at_start = key in _READ_AT_START or key.startswith(_READ_AT_START_PREFIXES)
            if read_at_start and env.get(key) != self._env.get(key):
                return False
        return True

    def _start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="asyncrpc-prefork-")
        self._path = os.path.join(self._dir.name, "s")
        ready_r, ready_w = os.pipe()
        try:
            self._server = subprocess.Popen(
                [
                    sys.executable, "-m", "asyncrpc.testing.prefork_server",
                    "--socket", self._path, "--ready-fd", str(ready_w),
                    *(f"--preload={m}" for m in self._preload),
                ],
                stdin=subprocess.PIPE,  # its EOF tells the server that we are gone
                cwd=self._cwd,
                env=self._env,
                pass_fds=(ready_w,),
            )  # fmt: skip
            os.close(ready_w)
            ready_w = -1
            line = _read_line(ready_r, _START_TIMEOUT)
        finally:
            os.close(ready_r)
            if ready_w >= 0:
                os.close(ready_w)
        if line != "ready":
            self._failed = line or "no answer"
            self.close()
            raise PreforkError(f"the prefork server did not start: {self._failed}")

    def popen(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        text: bool = False,
    ) -> PreforkedProcess:
        """Run ``python -m module *args`` in a forked child of the server.

        Args:
            module: the module run as ``__main__``.
            args: its command-line arguments.
            env: its whole environment.
            cwd: its working directory.
            stdin, stdout, stderr: a file descriptor, ``subprocess.PIPE`` (stdin and
                stdout only), ``subprocess.STDOUT`` (stderr only) or None (this process's).
            text: pipes in text mode.

        Returns:
            The running child.

        Raises:
            PreforkError: the server could not be started or did not answer.
        """
        if self._server is None:
            if self._failed is not None:
                raise PreforkError(f"the prefork server did not start: {self._failed}")
            self._start()
        fds, ours, theirs = _child_stdio(stdin, stdout, stderr)
        request = json.dumps(
            {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        ).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(_START_TIMEOUT)
            conn.connect(self._path)
            socket.send_fds(conn, [REQUEST_LENGTH.pack(len(request)) + request], fds)
            (pid,) = CHILD_PID.unpack(_recv_exact(conn, CHILD_PID.size))
        except (OSError, PreforkError) as exc:
            conn.close()
            for fd in ours.values():
                os.close(fd)
            # A server that does not answer forks nothing more: later requests are refused
            # at once (``can_run`` says False), and a launcher starts fresh interpreters.
            self._failed = f"it did not answer: {exc}"
            raise PreforkError(f"the prefork server did not answer: {exc}") from exc
        finally:
            for fd in theirs:
                os.close(fd)
        pipes: list[IO[Any] | None] = [None, None]
        for number, fd in ours.items():
            mode = "w" if number == 0 else "r"
            pipes[number] = (
                open(fd, mode, encoding="utf-8", errors="replace")  # noqa: SIM115
                if text
                else open(fd, mode + "b")  # noqa: SIM115
            )
        return PreforkedProcess(conn, pid, [module, *args], pipes[0], pipes[1])

    def close(self) -> None:
        """Stop the server (its running children go on; their starters stop them)."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                assert server.stdin is not None
                server.stdin.close()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def _child_stdio(
    stdin: int | None, stdout: int | None, stderr: int | None
) -> tuple[list[int], dict[int, int], list[int]]:
    """The child's fds 0-2, our ends of its pipes (by its fd number), and the fds that
    are ours to close once they are sent."""
    fds: list[int] = []
    ours: dict[int, int] = {}
    theirs: list[int] = []
    for number, spec in enumerate((stdin, stdout, stderr)):
        if spec == subprocess.PIPE and number < 2:
            r, w = os.pipe()
            ours[number], child = (w, r) if number == 0 else (r, w)
            theirs.append(child)
            fds.append(child)
        elif spec == subprocess.STDOUT and number == 2:
            fds.append(fds[1])
        elif spec is None:
            fds.append(number)
        elif isinstance(spec, int) and spec >= 0:
            fds.append(spec)
        else:
            for fd in (*ours.values(), *theirs):
                os.close(fd)
            raise ValueError(f"unsupported stdio spec {spec!r} for fd {number}")
    return fds, ours, theirs


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise PreforkError("the prefork server closed the connection (did it die?)")
        data += chunk
    return data


def _read_line(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in data and len(data) < 4096:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()
