"""The deadline of the request a function serves, and what nested calls inherit of it
(layer L2.4; no loop, no I/O).

A caller's timeout travels on the wire in seconds (its ``Request.timeout``; 0: none). The
callee turns it into a deadline on its own monotonic clock when the request arrives, so
it is never later than the caller's own (the caller started counting before it sent).
While the function runs, the deadline sits in a context variable: ``time_remaining()``
reads it, and a call the function makes (``rpc_sync``, ``rpc_async``, ``remote``, ``await
call``, ``stream``) gets what is left of it when that is shorter than its own timeout, so
budgets follow the work down a chain of workers. Context variables are per thread and per
asyncio task: a pool thread sets it around the function, a task inside its coroutine.
"""

from __future__ import annotations

import contextvars
import time

__all__ = [
    "deadline_after", "expired", "inherited", "running_until", "serving_peer", "time_remaining",
]  # fmt: skip

# The request being served: the monotonic time by which it must be done (None: no
# deadline), and the rank of the peer it is served for (None: not serving one). One
# variable holding both: it is set around every served request.
_SERVED: contextvars.ContextVar[tuple[float | None, int | None]] = contextvars.ContextVar(
    "asyncrpc_served", default=(None, None)
)

# A nested call whose parent's budget is spent still gets this much, so that it fails as a
# timeout of its own (the caller's familiar error) rather than with a timeout of 0, which
# torch's convention reads as "no timeout".
_SPENT_S = 1e-3


def deadline_after(timeout: float, now: float | None = None) -> float | None:
    """The deadline of a request that arrived at ``now`` (monotonic) with ``timeout``
    seconds (0 or less: none)."""
    if timeout <= 0:
        return None
    return (time.monotonic() if now is None else now) + timeout


def expired(deadline: float | None) -> bool:
    """Whether ``deadline`` has passed (never, without one)."""
    return deadline is not None and time.monotonic() >= deadline


class running_until:  # lower case: it reads as a function, ``with running_until(d):``
    """Serve a request with ``deadline`` for peer ``caller`` for the duration of the block
    (this thread or task only). A class, not a generator: it wraps every served request,
    and a generator-based context manager costs several times more per use."""

    __slots__ = ("_served", "_token")

    def __init__(self, deadline: float | None, caller: int | None = None) -> None:
        self._served = (deadline, caller)

    def __enter__(self) -> None:
        self._token = _SERVED.set(self._served)

    def __exit__(self, *exc: object) -> None:
        _SERVED.reset(self._token)


def serving_peer() -> int | None:
    """The rank of the peer the calling code serves a request for (None outside one)."""
    return _SERVED.get()[1]


def time_remaining() -> float | None:
    """Seconds left before the deadline of the request the calling code serves (0.0 once
    it has passed), or None outside a served request or for one without a deadline.

    A synchronous function can poll it and stop early: its caller has given up by then
    (an ``async def`` is cancelled at its deadline; a ``def`` cannot be)."""
    deadline = _SERVED.get()[0]
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


def inherited(timeout: float) -> float:
    """The timeout of a call made now: ``timeout`` (seconds; 0: none), or what is left of
    the served request's deadline when that is shorter."""
    deadline = _SERVED.get()[0]
    if deadline is None:
        return timeout
    left = max(_SPENT_S, deadline - time.monotonic())
    return left if timeout <= 0 or left < timeout else timeout
