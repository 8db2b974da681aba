"""Module-level helpers the serde tests pickle by reference (functions, classes, a scripted fn)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch

with warnings.catch_warnings():
    # torch.jit.script is deprecated in recent torch, but ScriptFunctions still exist and
    # must still travel.
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
        return x + alpha * y


not_scripted = 42


def add(x: Any, y: Any) -> Any:
    """A plain module-level function."""
    return x + y


@dataclasses.dataclass
class Batch:
    """A dataclass with tensors inside."""

    inputs: torch.Tensor
    labels: list[torch.Tensor]
    meta: dict[str, Any]


class Point:
    """A user class that refuses plain pickling: only a registered reducer can send it."""

    def __init__(self, x: int, y: int) -> None:
        self.x = x
        self.y = y

    def __reduce__(self) -> Any:
        raise TypeError("Point refuses plain pickling")


class Point3(Point):
    """A subclass of Point: exact-type registries do not cover it."""


def make_point(x: int, y: int) -> Point:
    """Rebuild a Point (the receiving side of the Point reducer)."""
    return Point(x, y)


def reduce_point(point: Point) -> tuple[Any, ...]:
    """Reducer for Point."""
    return make_point, (point.x, point.y)


class TaggedTensor(torch.Tensor):
    """A user tensor subclass: it goes through torch's own pickling, not the segment path."""


class Handle:
    """Stands in for an RRef: the persistent_dump hook replaces it by a tuple."""

    def __init__(self, ident: int) -> None:
        self.ident = ident


class UserError(Exception):
    """A user exception whose data lives in args (pickles by default)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


class BadInitError(Exception):
    """A user exception whose __init__ does not accept its own args: pickle's default
    unpickling fails; asyncrpc rebuilds it from its state."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"bad {a} {b}")
        self.a = a
        self.b = b


@dataclasses.dataclass
class Sent:
    """What ``wire_roundtrip`` observed: the value back, the payload and the segments."""

    value: Any
    payload: bytes
    segments: list[tuple[memoryview, str]]
    owners: list[object]
    keepalive: list[object]  # backs the segments' memory: keep it while reading them


def wire_roundtrip(serializer: Any, obj: object, **dumps_kwargs: Any) -> Sent:
    """Do what the wire does: dumps, copy each segment into allocate()'d memory, loads."""
    payload, segments, keepalive, _ = serializer.dumps(obj, **dumps_kwargs)
    owners = []
    for view, tag in segments:
        owner, destination = serializer.allocate(view.nbytes, tag)
        destination[:] = view
        owners.append(owner)
    value = serializer.loads(payload, owners, context=dumps_kwargs.get("context"))
    return Sent(value, payload, segments, owners, keepalive)
