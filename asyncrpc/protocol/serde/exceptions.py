"""Remote exceptions that come back as their original type (layer L1).

``pack_exception`` records an exception raised on a worker (type, message, traceback,
worker, and the pickled exception when it round-trips); ``unpack_exception`` rebuilds the
original object and notes where it came from, or falls back to ``RemoteError``. Every
call path (replies, streams, RRef values) goes through these two, and exceptions are
pickled from their state (``asyncrpc.errorstate``), so a class comes back with its
fields whatever its ``__init__`` takes.
"""

from __future__ import annotations

import io
import pickle
import traceback
from collections.abc import Callable
from typing import Any, Final

from asyncrpc.errors import RemoteError, as_remote_call_error
from asyncrpc.errorstate import reduce_exception

__all__ = ["pack_exception", "unpack_exception"]

_PROTOCOL: Final = 5


def pack_exception(exc: BaseException, worker: str) -> bytes:
    """Record ``exc``, raised on ``worker``, for sending to the caller. Never raises.

    Args:
        exc: the exception.
        worker: the name of the worker it was raised on.

    Returns:
        An opaque record for ``unpack_exception``. It carries the pickled exception only
        when pickling it and unpickling it again here gives back an object of the same type.
    """
    cls = type(exc)
    pickled = _pickle_exception(exc)
    record = (
        _safe_text(lambda: cls.__module__),
        _safe_text(lambda: cls.__qualname__),
        _safe_text(lambda: str(exc)),
        _safe_text(lambda: _format_traceback(exc, notes=pickled is None)),
        _safe_text(lambda: str(worker)),
        pickled,
    )
    try:
        return pickle.dumps(record, protocol=_PROTOCOL)
    except Exception:  # only text and bytes in it: out of memory, or a str subclass's tricks
        return pickle.dumps(("builtins", "Exception", "<unpackable>", "", "?", None))


def unpack_exception(data: bytes) -> BaseException:
    """Rebuild the exception ``pack_exception`` recorded.

    The original type comes back, also a ``RuntimeError`` as torch's handlers expect (see
    ``as_remote_call_error``), with ``str(exc)`` and ``args`` unchanged, plus attributes
    ``remote_worker`` and ``remote_traceback`` (the last hop's; a relayed ``RemoteError``
    keeps its own) and a note naming the worker and carrying the remote traceback (shown
    under the local one).

    Args:
        data: what ``pack_exception`` returned.

    Returns:
        The rebuilt exception, or a ``RemoteError`` (type name, message, traceback,
        worker) when it cannot be rebuilt here: its state could not be pickled on the
        worker, or its class cannot be imported here.
    """
    try:
        record = pickle.loads(data)
        module, qualname, message, remote_tb, worker, pickled = record
    except Exception as exc:
        return RemoteError("<unknown>", f"undecodable remote exception ({exc!r})", "", "?")
    type_name = qualname if module == "builtins" else f"{module}.{qualname}"
    rebuilt = _unpickle_exception(pickled)
    if rebuilt is None:
        return RemoteError(type_name, message, remote_tb, worker)
    try:
        # A RemoteError relayed from a deeper hop keeps its own fields (they name the
        # worker that raised the original); the note below records this hop.
        if not isinstance(rebuilt, RemoteError):
            rebuilt.remote_worker = worker  # type: ignore[attr-defined]
            rebuilt.remote_traceback = remote_tb  # type: ignore[attr-defined]
        rebuilt.add_note(f"Raised on remote worker {worker!r}. Remote traceback:\n{remote_tb}")
    except Exception:
        return RemoteError(type_name, message, remote_tb, worker)
    return as_remote_call_error(rebuilt)


def _format_traceback(exc: BaseException, notes: bool) -> str:
    # A pickled exception carries its notes (those of the hops before this one) with it:
    # formatting them into this hop's traceback too would copy each deeper traceback once
    # per hop, and the record of an error relayed through n hops would grow like 2**n.
    formatted = traceback.TracebackException.from_exception(exc)
    if not notes:
        formatted.__notes__ = None
    return "".join(formatted.format())


def _safe_text(produce: Callable[[], object]) -> str:
    """Return ``produce()`` as text, or a placeholder when it raises."""
    try:
        return str(produce())
    except Exception as exc:
        return f"<unavailable: {type(exc).__name__}>"


class _StatePickler(pickle.Pickler):
    """Pickles exceptions (the one sent and any it holds) from their state, not by calling
    their class with their ``args`` again: see ``asyncrpc.errorstate``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException):
            reduced = reduce_exception(obj)
            if reduced is not None:
                return reduced
        return NotImplemented


def _pickle_state(value: object) -> bytes:
    """Pickle ``value``, its exceptions from their state. Raises what pickling raises."""
    out = io.BytesIO()
    _StatePickler(out, protocol=_PROTOCOL).dump(value)
    return out.getvalue()


def _pickle_exception(exc: BaseException) -> bytes | None:
    """Pickle ``exc`` if it also unpickles here as the same type, else None."""
    try:
        data = _pickle_state(exc)
        back = pickle.loads(data)
    except Exception:
        return None
    return data if type(back) is type(exc) else None


def _unpickle_exception(data: object) -> BaseException | None:
    """Unpickle a packed exception, or None when that fails or yields no exception."""
    if not isinstance(data, bytes):
        return None
    try:
        rebuilt = pickle.loads(data)
    except Exception:
        return None
    return rebuilt if isinstance(rebuilt, BaseException) else None
