"""Custom reductions for types pickle cannot handle, and resolving references by name (L1).

A ``ReducerRegistry`` maps an exact type to a copyreg-style ``reduce_fn(obj) -> (callable,
args)``; the serializer's pickler consults it for every object it reduces. Scripted
TorchScript functions are registered by default: they travel by qualified name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch

from asyncrpc.errors import SerializationError

if TYPE_CHECKING:
    from torch._C import ScriptFunction as _ScriptFunction

__all__ = [
    "MissingReferenceError",
    "ReduceFn",
    "ReducerRegistry",
    "default_registry",
    "reduce_script_function",
    "register_reducer",
    "resolve_script_function",
]

T = TypeVar("T")
ReduceFn: TypeAlias = Callable[[Any], tuple[Any, ...]]

_SCRIPT_PREFIX = "__torch__."


class MissingReferenceError(SerializationError):
    """A function or class named in a payload cannot be found on this side.

    Carries ``module``, ``qualname`` and ``reason`` so the agent can turn it into a
    ``FunctionNotFoundError`` naming the worker.
    """

    def __init__(self, module: str, qualname: str, reason: str) -> None:
        super().__init__(module, qualname, reason)
        self.module = module
        self.qualname = qualname
        self.reason = reason

    @property
    def name(self) -> str:
        """The full dotted name that was looked up."""
        return f"{self.module}.{self.qualname}"

    def __str__(self) -> str:
        return (
            f"cannot find {self.name} ({self.reason}); define it at module level in a module "
            "importable on both the caller and the callee"
        )


class ReducerRegistry:
    """Exact type -> copyreg-style reduce function, consulted by the serializer's pickler.

    Lookups are by exact type, as with ``copyreg.dispatch_table``: a subclass keeps its own
    pickling unless it is registered too. Registering while other threads pickle is safe.
    """

    __slots__ = ("_table",)

    def __init__(self, entries: dict[type, ReduceFn] | None = None) -> None:
        self._table: dict[type, ReduceFn] = dict(entries or {})

    @property
    def table(self) -> dict[type, ReduceFn]:
        """The live mapping the pickler reads (do not mutate it; use ``register``)."""
        return self._table

    def register(self, cls: type[T], reduce_fn: Callable[[T], tuple[Any, ...]]) -> None:
        """Pickle instances of exactly ``cls`` as ``reduce_fn(obj)`` says.

        Args:
            cls: the type.
            reduce_fn: returns ``(callable, args)`` (any reduce tuple pickle accepts); the
                receiver calls ``callable(*args)``, so it must be importable there.
        """
        self._table[cls] = reduce_fn

    def unregister(self, cls: type) -> None:
        """Forget ``cls`` (no error if it was not registered)."""
        self._table.pop(cls, None)

    def copy(self) -> ReducerRegistry:
        """Return an independent registry with the same entries."""
        return ReducerRegistry(self._table)

    def __contains__(self, cls: object) -> bool:
        return cls in self._table


def resolve_script_function(qualified_name: str) -> _ScriptFunction[..., Any]:
    """Find a scripted function by its TorchScript qualified name (``__torch__.pkg.mod.fn``).

    Args:
        qualified_name: the function's ``qualified_name``.

    Returns:
        The ``torch.jit.ScriptFunction`` bound to ``fn`` in module ``pkg.mod``.

    Raises:
        MissingReferenceError: the module or attribute is missing, or is not scripted.
    """
    path = qualified_name.removeprefix(_SCRIPT_PREFIX)
    module, _, attribute = path.rpartition(".")
    module = module or "__main__"
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise MissingReferenceError(module, attribute, f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(found, torch.jit.ScriptFunction):
        raise MissingReferenceError(
            module, attribute, f"it is a {type(found).__name__}, not a scripted function"
        )
    return found


def reduce_script_function(
    fn: _ScriptFunction[..., Any],
) -> tuple[Callable[[str], _ScriptFunction[..., Any]], tuple[str]]:
    """Reduce a scripted function to its qualified name (torch refuses to pickle it).

    The name is resolved here first, so a function scripted inside another function fails
    at the caller, before anything is sent.

    Raises:
        SerializationError: the name does not lead back to a scripted function here.
    """
    name: str = fn.qualified_name
    try:
        resolve_script_function(name)
    except MissingReferenceError as exc:
        raise SerializationError(
            f"cannot pickle scripted function {name}: it is not reachable by name ({exc.reason}); "
            "script it at module level"
        ) from exc
    return resolve_script_function, (name,)


default_registry = ReducerRegistry({torch.jit.ScriptFunction: reduce_script_function})
"""The registry serializers use unless given another."""


def register_reducer(cls: type[T], reduce_fn: Callable[[T], tuple[Any, ...]]) -> None:
    """Pickle instances of exactly ``cls`` (not its subclasses) as ``reduce_fn`` says.

    For the calls of this process: register it on every worker that sends such objects
    (at import time of the module that defines ``cls``, say).

    Args:
        cls: the type.
        reduce_fn: returns ``(callable, args)`` (any reduce tuple pickle accepts); the
            receiver calls ``callable(*args)``, so that callable must be importable there.
    """
    default_registry.register(cls, reduce_fn)
