"""Users' exception classes whose ``__init__`` does not take their ``args`` back, and the
functions that raise them on workers (importable by every process)."""

from __future__ import annotations

import errno
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import asyncrpc


class QuotaExceeded(Exception):
    """As most users write them: fields as arguments, a message made from them."""

    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"user {user} exceeded {limit}")
        self.user = user
        self.limit = limit


class QuotaRuntimeError(RuntimeError):
    """The same, as a ``RuntimeError``: asyncrpc does not pair it with one."""

    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"user {user} exceeded {limit}")
        self.user = user
        self.limit = limit


class KeywordOnlyError(Exception):
    def __init__(self, *, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class SlottedError(Exception):
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        super().__init__("slotted")
        self.code = code


class MissingShardError(FileNotFoundError):
    """An OSError: errno and file name live outside ``__dict__``."""

    def __init__(self, shard: str) -> None:
        super().__init__(errno.ENOENT, "shard not found", shard)
        self.shard = shard


class HoldsALockError(Exception):
    """Its state cannot be pickled: it comes back as ``RemoteError``."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.lock = threading.Lock()


# The attributes each kind is compared by, besides its type, args and text.
FIELDS: dict[str, tuple[str, ...]] = {
    "quota": ("user", "limit"),
    "quota_runtime": ("user", "limit"),
    "keyword_only": ("code",),
    "slotted": ("code",),
    "missing_shard": ("shard", "errno", "strerror", "filename"),
}


def make(kind: str) -> BaseException:
    """A fresh exception of ``kind`` (a key of ``FIELDS``, or ``"lock"``)."""
    made: dict[str, Any] = {
        "quota": lambda: QuotaExceeded("bob", 10),
        "quota_runtime": lambda: QuotaRuntimeError("bob", 10),
        "keyword_only": lambda: KeywordOnlyError(code=7, reason="no"),
        "slotted": lambda: SlottedError(3),
        "missing_shard": lambda: MissingShardError("/data/shard-3"),
        "lock": lambda: HoldsALockError("locked"),
    }
    return made[kind]()  # type: ignore[no-any-return]


def fingerprint(exc: BaseException, kind: str) -> tuple[object, ...]:
    """What must survive the trip: class name, args, text and the kind's fields."""
    fields = tuple(getattr(exc, name) for name in FIELDS[kind])
    return (type(exc).__qualname__, exc.args, str(exc), fields)


def raise_kind(kind: str) -> None:
    raise make(kind)


async def araise_kind(kind: str) -> None:
    raise make(kind)


def relay(to: str, kind: str) -> None:
    """Called on one worker, calls another that raises: the error crosses two hops."""
    asyncrpc.rpc_sync(to, raise_kind, args=(kind,))


def failing_stream(kind: str, n: int) -> Iterator[int]:
    yield from range(n)
    raise make(kind)


def raise_class_only_here() -> None:
    """Raise an exception whose class exists on this worker only."""
    module = types.ModuleType("asyncrpc_only_on_this_worker")
    sys.modules[module.__name__] = module
    local = type("LocalOnlyError", (Exception,), {"__module__": module.__name__})
    module.LocalOnlyError = local  # type: ignore[attr-defined]
    raise local("exists on this worker only")


@asyncrpc.functions.async_execution
def fail_later(kind: str) -> asyncrpc.Future[None]:
    """An ``@async_execution`` function whose future fails after it returned."""
    fut: asyncrpc.Future[None] = asyncrpc.Future()
    fut.set_exception(make(kind))
    return fut


class Raiser:
    """An RRef's value whose method raises (called through ``rref.rpc_sync()``)."""

    def raise_kind(self, kind: str) -> None:
        raise make(kind)
