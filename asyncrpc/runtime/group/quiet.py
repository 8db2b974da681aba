"""torch's C++ log lines held back while asyncrpc uses its rendezvous store (layer L2.3).

When a TCPStore's host has gone, torch's C++ client logs the failure on stderr before it
raises it, and that log line carries the C++ error's whole stack, some twenty frames of
``libtorch_cpu.so`` addresses. Likewise, opening a store nobody serves logs each connect
attempt with its stack. The Python exception that follows holds the same sentence without
the stack, and asyncrpc raises it in its own typed error, so those lines tell a user
nothing more, and they read like a crash of asyncrpc itself.

torch offers one knob for them: the C++ log level, read from ``TORCH_CPP_LOG_LEVEL`` once,
when torch is imported. ``QuietStore`` raises that level (the ``FLAGS_caffe2_log_level``
variable of ``libc10``) for the length of each store call asyncrpc makes, and puts it back
after. A user who sets ``TORCH_CPP_LOG_LEVEL`` has asked for C++ logs: then nothing is
changed. Where the variable cannot be found (another build of torch), nothing is changed
either, and the lines appear as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["QuietStore", "quiet_cpp_logs"]

_log = logging.getLogger(__name__)
# c10's levels: 0 info, 1 warning, 2 error, 3 fatal. The store's own failures are logged
# as warnings (a failed send or receive) and errors (a connect that timed out); asyncrpc
# raises each of them, so both are held back.
_QUIET_LEVEL = 3
_ENV = "TORCH_CPP_LOG_LEVEL"


def _library_names() -> tuple[str, ...]:
    if sys.platform == "darwin":
        return ("libc10.dylib",)
    if sys.platform == "win32":
        return ("c10.dll",)
    return ("libc10.so",)


def _find_level() -> ctypes.c_int | None:
    """``FLAGS_caffe2_log_level`` of the ``libc10`` torch has loaded, or None."""
    try:
        import torch
    except ImportError:  # pragma: no cover - asyncrpc needs torch; a store needs it too
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in _library_names():
        path = lib_dir / name
        if not path.exists():
            continue
        try:
            # torch loaded it already: this returns the same library, not a second copy.
            library = ctypes.CDLL(str(path))
            return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
        except (OSError, ValueError) as exc:
            _log.debug("torch's C++ log level cannot be changed here: %s", exc)
    return None


class _Level:
    """The process's C++ log level, raised while any quiet store call runs.

    Store calls come from several threads at once (the rendezvous thread, shutdown's
    helper threads): the first to enter raises the level and the last to leave restores
    it, so no call puts it back under another one still running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = 0
        self._flag: ctypes.c_int | None = None
        self._looked = False

    def _target(self) -> ctypes.c_int | None:
        if not self._looked:
            self._looked = True
            self._flag = None if os.environ.get(_ENV) else _find_level()
        return self._flag

    def enter(self) -> None:
        with self._lock:
            flag = self._target()
            if flag is None:
                return
            if self._depth == 0:
                self._saved = flag.value
                flag.value = max(self._saved, _QUIET_LEVEL)
            self._depth += 1

    def leave(self) -> None:
        with self._lock:
            flag = self._flag
            if flag is None or self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0:
                flag.value = self._saved


_LEVEL = _Level()


@contextlib.contextmanager
def quiet_cpp_logs() -> Iterator[None]:
    """Hold back torch's C++ log lines for the length of the block (see the module)."""
    _LEVEL.enter()
    try:
        yield
    finally:
        _LEVEL.leave()


class QuietStore:
    """A torch store whose calls log nothing in C++ (their failures are raised as usual).

    Only the calls asyncrpc makes are here; each one is the store's own, unchanged.
    """

    __slots__ = ("_store",)

    def __init__(self, store: Any) -> None:
        self._store = store

    @property
    def inner(self) -> Any:
        """The wrapped store."""
        return self._store

    def set(self, key: str, value: str | bytes) -> None:
        with quiet_cpp_logs():
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with quiet_cpp_logs():
            return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        with quiet_cpp_logs():
            return int(self._store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        with quiet_cpp_logs():
            return bool(self._store.check(keys))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with quiet_cpp_logs():
            return bytes(self._store.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: Any) -> None:
        with quiet_cpp_logs():
            self._store.wait(keys, timeout)

    def append(self, key: str, value: str | bytes) -> None:
        with quiet_cpp_logs():
            self._store.append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with quiet_cpp_logs():
            return [bytes(value) for value in self._store.multi_get(keys)]
