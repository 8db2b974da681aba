"""Exceptions copied and pickled from their state, not through their ``__init__`` (layer L0:
standard library only).

``reduce_exception`` and ``rebuild_exception`` carry any exception between workers with
its class, args, attributes and slots, whatever its ``__init__`` takes; ``paired_copy``
makes the copies ``asyncrpc.errors`` hands out, whose class derives from the original's
and one of asyncrpc's (a remote ``KeyError`` that is also a ``RuntimeError``).
"""

from __future__ import annotations

import copy
import copyreg
from typing import Any, Final, TypeVar, cast

__all__ = [
    "copy_exception",
    "exception_state",
    "own_copy",
    "paired_copy",
    "rebuild_exception",
    "reduce_exception",
]

# Pickle rebuilds an exception by calling its class with its args. A class whose __init__
# takes other arguments than its message (``QuotaExceeded(user, limit)`` calling
# ``super().__init__(f"user {user} exceeded {limit}")``), or keyword-only ones, cannot be
# called so, and one with optional arguments is called with the wrong ones. So errors that
# travel are rebuilt from their state instead, without running the class's __init__: the
# object comes from __new__, the nearest builtin exception class's __init__ sets what it
# reads from args (an OSError's errno and file names, a StopIteration's value), and
# __dict__ and __slots__ are put back as they were. A class that says how it pickles (its
# own __reduce__ or __reduce_ex__, or a copyreg entry) is left to do so.

_Args = tuple[object, ...]
_State = dict[str, object]
_HEAP_TYPE: Final = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time, not in C


def reduce_exception(exc: BaseException) -> tuple[object, _Args] | None:
    """How to pickle ``exc`` from its state, or None if its class pickles itself.

    Args:
        exc: the exception.

    Returns:
        ``(rebuild_exception, (cls, args, state, slots))``, pickle's reduce value; None for
        a class with its own ``__reduce__``/``__reduce_ex__`` or a ``copyreg`` entry.
    """
    parts = _parts(exc)
    return None if parts is None else (rebuild_exception, parts)


def copy_exception(exc: BaseException) -> BaseException:
    """A shallow copy of ``exc`` without its traceback, cause or context, made as it would
    be rebuilt on another worker (``copy.copy`` for a class that pickles itself)."""
    parts = _parts(exc)
    return copy.copy(exc).with_traceback(None) if parts is None else rebuild_exception(*parts)


E = TypeVar("E", bound=BaseException)


def own_copy(exc: E) -> E:
    """``exc`` for one more raise of its own: a copy of the same class, args and attributes,
    with its cause, without its traceback.

    Why: raising an exception instance puts every frame it passes through into its
    traceback, and those frames keep their locals (tensors, RRefs, whole batches) alive for
    as long as anything holds the exception. One error that fails many calls, or that is
    kept to fail later ones (a peer lost for good), would hold the frames of every place it
    was raised in: in the chaos soak, a user RRef held by such a traceback kept its owner's
    count above zero for good. Each raise gets its own copy instead. Where no copy can be
    made, ``exc`` itself.
    """
    try:
        copied = copy_exception(exc)
    except Exception:  # a class whose state cannot be copied: raised as it is
        return exc
    if not isinstance(copied, type(exc)):
        return exc
    copied.__cause__ = exc.__cause__
    copied.__suppress_context__ = exc.__suppress_context__
    return copied


def _parts(exc: BaseException) -> tuple[type[BaseException], _Args, _State, _State] | None:
    cls = type(exc)
    if cls in copyreg.dispatch_table or not _reduces_as_builtin(cls):
        return None
    try:
        return (cls, *exception_state(exc))
    except Exception:  # state that cannot be read: pickle's own rules decide
        return None


def exception_state(exc: BaseException) -> tuple[_Args, _State, _State]:
    """The state ``rebuild_exception`` needs: ``(args, attributes, slot values)``.

    The args and attributes are what the nearest builtin class pickles (an OSError's file
    names join its args, an ImportError's name and path its attributes), plus the ``name``
    of an AttributeError or NameError, which Python's own pickling drops.
    """
    # (class, args) or (class, args, attributes): a builtin __reduce__ is never a string
    reduced = cast("tuple[Any, ...]", _builtin_method(type(exc), "__reduce__")(exc))
    args: _Args = reduced[1]
    state: _State = dict(reduced[2]) if len(reduced) > 2 and reduced[2] else {}
    if isinstance(exc, (AttributeError, NameError)) and exc.name is not None:
        state.setdefault("name", exc.name)
    layout = object.__getstate__(exc)  # (dict, slots) when the class has __slots__
    slots = dict(layout[1]) if isinstance(layout, tuple) and layout[1] else {}
    return args, state, slots


def rebuild_exception(
    cls: type[BaseException], args: _Args, state: _State, slots: _State
) -> BaseException:
    """Make an instance of ``cls`` with ``args``, ``state`` and ``slots``, without running
    the ``__init__`` of a class written in Python (see ``exception_state``)."""
    try:
        exc = cls.__new__(cls, *args)
    except Exception:  # a __new__ of its own that wants what its __init__ wants, or one
        # the MRO finds before the builtin class whose layout the instance has
        exc = _layout_class(cls).__new__(cls, *args)
    try:
        _builtin_method(cls, "__init__")(exc, *args)  # what super().__init__ would reach
    except Exception:  # args a builtin class refuses (a subclass's own __new__ set them)
        exc.args = args
    if state:
        exc.__setstate__(state)  # a class's own __setstate__ is honoured, as by pickle
    for name, value in slots.items():
        setattr(exc, name, value)
    return exc


def _builtin_method(cls: type, name: str) -> Any:
    """Method ``name`` of the first builtin class in ``cls``'s MRO that defines it."""
    return next(vars(k)[name] for k in cls.__mro__ if name in vars(k) and not _made_in_python(k))


def _layout_class(cls: type) -> type[BaseException]:
    """The builtin class whose memory layout instances of ``cls`` have (an OSError's, say,
    for a class deriving from RuntimeError and TimeoutError): only its __new__ may make one."""
    layout: type = cls
    while _made_in_python(layout) and layout.__base__ is not None:
        layout = layout.__base__
    return cast("type[BaseException]", layout)


def _made_in_python(cls: type) -> bool:
    return bool(cls.__flags__ & _HEAP_TYPE)


def _reduces_as_builtin(cls: type) -> bool:
    reduce_ex = next(k for k in cls.__mro__ if "__reduce_ex__" in vars(k))
    reduce = next(k for k in cls.__mro__ if "__reduce__" in vars(k))
    return reduce_ex is object and not _made_in_python(reduce)


# -- paired types ------------------------------------------------------------------------

# (original type, asyncrpc base) -> a class deriving from both.
_paired_types: dict[tuple[type, type], type[BaseException]] = {}


def paired_copy(
    exc: BaseException, base: type, extra: dict[str, object], chain: bool = True
) -> BaseException | None:
    """A copy of ``exc`` whose class derives from ``type(exc)`` and ``base``, with the
    attributes ``extra`` added (and ``exc`` as its cause if ``chain``); None when the two
    cannot be paired."""
    try:
        args, state, slots = exception_state(exc)
        paired = _rebuild_paired(type(exc), base, args, {**state, **extra}, slots)
    except Exception:  # a class that cannot be paired (a layout conflict, a strict __new__)
        return None
    if chain:
        paired.__cause__ = exc
        paired.__suppress_context__ = True
    return paired.with_traceback(exc.__traceback__)


def _paired_type(cls: type, base: type) -> type[BaseException]:
    dual = _paired_types.get((cls, base))
    if dual is None:
        namespace: dict[str, object] = {"__module__": cls.__module__, "__reduce__": _reduce_paired}
        if "wrap_text" in vars(base):  # the base's words around the original type's text
            namespace["__str__"] = _paired_str
        dual = cast("type[BaseException]", type(cls.__name__, (cls, base), namespace))
        dual.__qualname__ = cls.__qualname__
        _paired_types[(cls, base)] = dual
    return dual


def _paired_str(self: Any) -> str:
    original, base = cast("tuple[Any, Any]", type(self).__bases__)
    return cast("str", base.wrap_text(self, original.__str__(self)))


def _reduce_paired(self: BaseException) -> tuple[object, ...]:
    original, base = type(self).__bases__
    return (_rebuild_paired, (original, base, *exception_state(self)))


def _rebuild_paired(
    cls: type, base: type, args: _Args, state: _State, slots: _State
) -> BaseException:
    return rebuild_exception(_paired_type(cls, base), args, state, slots)
