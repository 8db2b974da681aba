"""``python -m asyncrpc.testing.prefork_server``: the server side of ``prefork`` (L4).

It imports the ``--preload`` modules, then serves requests on a Unix socket, one fork per
request, from one thread: nothing else runs in this process when it forks, so no lock is
held by a thread the child would lack. It exits when its stdin reaches EOF (the process
that started it closed it, or died).

A request is a length-prefixed JSON object (module, args, env, cwd) with three file
descriptors (the child's stdin, stdout, stderr) passed along. The answer is the child's
PID (8 bytes); once the child is reaped, its exit code in ``subprocess``'s convention
(4 bytes, ``-N`` for signal N). The caller may send a signal number (4 bytes) to have the
child signalled while it has not been reaped.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import io
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from asyncrpc.testing.prefork import CHILD_PID, REQUEST_LENGTH, STATUS

_MAX_REQUEST = 1 << 20


def _whole(data: bytes) -> bool:
    """Whether ``data`` holds a whole request: its length prefix and that many bytes."""
    size = REQUEST_LENGTH.size
    return len(data) >= size and len(data) >= size + REQUEST_LENGTH.unpack_from(data)[0]


class _Server:
    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
        self.conns: dict[int, socket.socket] = {}  # child pid -> its caller's connection
        self.pids: dict[socket.socket, int] = {}
        self.running: set[int] = set()  # forked, not reaped

    def serve(self) -> dict[str, Any] | None:
        """Serve until the parent goes; in a forked child, return its request."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        while True:
            for key, _ in self.sel.select():
                what = key.data
                if what == "accept":
                    request = self._accept()
                    if request is not None:
                        return request  # we are the child now
                elif what == "sigchld":
                    self._reap()
                elif what == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return None
                else:
                    self._from_caller(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> dict[str, Any] | None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(30.0)
            data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
            while not _whole(data):
                if len(data) > _MAX_REQUEST:
                    raise ValueError("request too large")
                chunk = conn.recv(65536)
                if not chunk:
                    raise ConnectionError("caller went away mid-request")
                data += chunk
            request: dict[str, Any] = json.loads(data[REQUEST_LENGTH.size :])
            if len(fds) != 3:
                raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
        except (OSError, ValueError) as exc:
            print(f"prefork server: bad request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._become_child(conn, fds)
            return request
        for fd in fds:
            os.close(fd)
        self.running.add(pid)
        try:
            conn.sendall(CHILD_PID.pack(pid))
        except OSError:
            conn.close()  # the caller left: the child runs on; we still reap it
            return None
        conn.setblocking(False)
        self.conns[pid] = conn
        self.pids[conn] = pid
        self.sel.register(conn, selectors.EVENT_READ, "caller")
        return None

    def _become_child(self, conn: socket.socket, fds: list[int]) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.close()
        for sock in (self.listener, conn, *self.conns.values()):
            sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)

    def _reap(self) -> None:
        while True:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                break
        for pid in list(self.running):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done == 0:
                continue
            self.running.discard(pid)
            conn = self.conns.pop(pid, None)
            if conn is not None:
                self.pids.pop(conn, None)
                self.sel.unregister(conn)
                try:
                    conn.setblocking(True)
                    conn.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()

    def _from_caller(self, conn: socket.socket) -> None:
        pid = self.pids[conn]
        try:
            data = conn.recv(STATUS.size)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if len(data) == STATUS.size and pid in self.running:
            (sig,) = STATUS.unpack(data)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)  # not reaped yet: the PID is still this child's
        elif not data:  # the caller dropped its handle: forget it, reap the child later
            self.sel.unregister(conn)
            self.pids.pop(conn, None)
            self.conns.pop(pid, None)
            conn.close()


def _fresh_stdio(unbuffered: bool) -> None:
    """New ``sys.std*`` objects over fds 0-2, buffered as a fresh interpreter's would be."""

    def writer(fd: int, *, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=line,
            write_through=unbuffered,
        )

    # The originals wrap the server's fds 0-2 too, now the child's: replace both.
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(  # type: ignore[misc]
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"
    )
    sys.stdout = sys.__stdout__ = writer(1, line=os.isatty(1))  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = writer(2, line=True)  # type: ignore[misc]


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict[str, Any]) -> None:
    """Run the request as ``python -m`` would, then exit as an interpreter would."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    _fresh_stdio(bool(os.environ.get("PYTHONUNBUFFERED")))
    random.seed()  # each child its own stream, as a fresh interpreter has
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["args"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args()
    ready = os.fdopen(args.ready_fd, "w")
    try:
        for module in args.preload:
            importlib.import_module(module)
        if threading.active_count() != 1:
            raise RuntimeError(f"{threading.active_count()} Python threads after the preload")
        server = _Server(args.socket)
    except BaseException as exc:
        ready.write(f"failed: {type(exc).__name__}: {exc}\n")
        ready.close()
        raise
    ready.write("ready\n")
    ready.close()
    request = server.serve()
    if request is not None:
        _run_child(request)


if __name__ == "__main__":
    main()
