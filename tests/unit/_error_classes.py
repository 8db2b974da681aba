"""Exception classes the errorstate tests pickle by reference: ``__init__``s that do not
take their ``args`` back, slots, their own ``__new__``, ``__reduce__`` or ``__setstate__``."""

from __future__ import annotations

import errno
from typing import Any

# How many times each class's __init__ ran: a rebuilt copy must not run it again.
INITS: dict[str, int] = {}


def _count(name: str) -> None:
    INITS[name] = INITS.get(name, 0) + 1


class QuotaExceeded(Exception):
    def __init__(self, user: str, limit: int) -> None:
        _count("QuotaExceeded")
        super().__init__(f"user {user} exceeded {limit}")
        self.user = user
        self.limit = limit


class KeywordOnly(Exception):
    def __init__(self, *, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class OptionalArgs(Exception):
    """Pickle's ``cls(*args)`` succeeds here, with the wrong arguments."""

    def __init__(self, what: str, retries: int = 3) -> None:
        super().__init__(f"{what} failed after {retries} retries")
        self.what = what
        self.retries = retries


class Slotted(Exception):
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        super().__init__("slotted")
        self.code = code


class MoreSlots(Slotted):
    __slots__ = ("detail",)

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code)
        self.detail = detail


class MissingShard(FileNotFoundError):
    def __init__(self, shard: str) -> None:
        super().__init__(errno.ENOENT, "shard not found", shard)
        self.shard = shard


class LateTimeout(RuntimeError, TimeoutError):
    """Its MRO finds RuntimeError's __new__ first, but its layout is an OSError's."""

    def __init__(self, worker: str, seconds: float) -> None:
        super().__init__(f"{worker} took over {seconds} s")
        self.worker = worker


class StrictNew(Exception):
    """A ``__new__`` that wants what ``__init__`` wants."""

    def __new__(cls, user: str, limit: int) -> StrictNew:
        return super().__new__(cls, user, limit)

    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"{user}:{limit}")
        self.user = user


class OwnReduce(Exception):
    """Says how it pickles: left to do so."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(a + b)
        self.a = a
        self.b = b

    def __reduce__(self) -> tuple[Any, ...]:
        return (OwnReduce, (self.a, self.b))


class OwnSetState(Exception):
    def __init__(self, value: int) -> None:
        super().__init__("own setstate")
        self.value = value

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, restored=True)


class Wrapper(Exception):
    """Holds another exception in an attribute."""

    def __init__(self, inner: BaseException) -> None:
        super().__init__("wrapped")
        self.inner = inner


class Unpicklable(Exception):
    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("no")
