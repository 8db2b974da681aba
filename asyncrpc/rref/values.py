"""An owner's value futures as code waits on them, and the callbacks that turn a call's
outcome into what an RRef reports (layer L3).

The owner keeps one future per value and every consumer shares its exception: a waiter
gets a copy, so that no waiter's frames (and the RRefs in them) attach to the stored one
and keep the value alive. ``handle.py`` sends the functions that run on the owner; they
wait through these.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

import torch

from asyncrpc.autograd import backward as dist_backward
from asyncrpc.errors import PeerLostError, RRefError, RRefOwnerLostError
from asyncrpc.errorstate import copy_exception
from asyncrpc.runtime.futures import (
    Future,
    add_hook,
    make_sibling,
    try_set_exception,
    try_set_result,
)

__all__ = [
    "backward_here",
    "check_tensor",
    "ignored",
    "made",
    "owned",
    "owner_lost_as_rref_error",
    "owner_value",
    "type_of",
]


def owner_lost_as_rref_error(owner: str, done: Future[Any]) -> Any:
    """A callback: the outcome of a call to ``owner``, its loss raised as torch's RRef error."""
    exc = done.exception()
    if isinstance(exc, PeerLostError):
        raise RRefOwnerLostError(owner, str(exc)) from exc
    return done.value()


async def owner_value(value: Future[Any]) -> Any:
    """Await an owner's value; a failure is raised as a copy.

    The stored exception is shared by every consumer: re-raising it would chain each
    consumer's frames (and the RRefs in them) onto it, and so keep the value alive forever.
    """
    try:
        return await value
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise copy_exception(exc) from None


def owned(value: Future[Any]) -> Future[Any]:
    """The owner's value future as its own code may wait on it: itself once it holds the
    value, else a future whose failure is a copy of the stored one.

    Raising the stored exception itself would attach the waiter's frames (this RRef among
    them) to it, and the owner keeps it as long as the RRef lives: neither would ever go.
    """
    if value.done() and value.exception() is None:
        return value
    owned = make_sibling(value)
    add_hook(value, functools.partial(_copy_outcome, owned))
    return owned


def _copy_outcome(owned: Future[Any], done: Future[Any]) -> None:
    # Not through then(): then() flattens a future-like result, and the value itself may
    # be a future (a function that returned a torch.futures.Future): it is the value.
    exc = done.exception()
    if exc is None:
        try_set_result(owned, done.value())
    else:
        try_set_exception(owned, copy_exception(exc))


def ignored(done: Future[Any]) -> None:
    """A callback that drops the outcome (the future it makes is done when ``done`` is)."""
    return


def made(done: Future[Any]) -> None:
    """A callback: None once the value is made; its failure raised as a copy."""
    exc = done.exception()
    if exc is not None:  # a copy: the stored exception is shared (see owner_value)
        raise copy_exception(exc) from None


def type_of(done: Future[Any]) -> type:
    """A callback: the type of the value."""
    return type(done.value())


def backward_here(value: Any, context_id: int, retain_graph: bool) -> None:
    """Backward from an owner's value: local autograd, or distributed in ``context_id``."""
    check_tensor(value)
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
    else:
        dist_backward(context_id, [value], retain_graph)


def check_tensor(value: Any) -> None:
    """Raise ``RRefError`` unless ``value`` is a tensor (``RRef.backward`` needs one)."""
    if not isinstance(value, torch.Tensor):
        raise RRefError(  # torch's words first
            f"RRef should contain a tensor for .backward(), this one holds a {type(value).__name__}"
        )
