"""The vocabulary of RRef reference counting (layer L1, sans-I/O): ids, the messages
workers send each other, and the actions ``RefCounter`` (``refcount.py``) returns.

The protocol these messages carry is described below; its state machine is ``refcount.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

__all__ = [
    "Action",
    "ChildAccepted",
    "ForkAccepted",
    "ForkId",
    "ForkQuery",
    "ForkRequest",
    "ForkUnknown",
    "Free",
    "Message",
    "RRefId",
    "RRefLost",
    "RefMessage",
    "RemoteUndelivered",
    "Send",
    "UserDelete",
]

# The protocol (torch.distributed.rpc's, hardened against reordering and duplicates).
#
#   U calls remote(O)        U.new_user -> fork F, unconfirmed; the agent sends the request
#   the request reaches O    O.new_owner(holder=U, fork_id=F): registers F, Send(U, ForkAccepted)
#   O pickles its RRef to D  O.fork_from_owner registers the fork (holder D) at once; D's
#                            received_user(parent=O) confirms it at once, no message
#   U pickles F to D != O    U.fork_from_user: child C is a PENDING CHILD of F (F stays alive)
#   D unpickles C            D.received_user(parent=U): Send(O, ForkRequest(C))
#   O gets ForkRequest(C)    registers C (holder D): Send(D, ForkAccepted(C))
#   D gets ForkAccepted(C)   C confirmed: Send(U, ChildAccepted(C))
#   U gets ChildAccepted(C)  C no longer pending
#   U pickles F to O         pending child as above; O.received_own: one more local handle on
#                            O, Send(U, ChildAccepted(C)); O registers no fork for it
#   U releases F             once F is confirmed AND has no pending child: Send(O, UserDelete(F))
#   O gets UserDelete(F)     unregisters F; Free once no fork and no local handle is left
#
# A frame carrying a fork may die with its connection (refcount messages themselves are
# resent until acknowledged: asyncrpc/protocol/reflog.py). Its sender then asks the receiver:
#
#   S wrote fork F to D; the connection died before D acknowledged it
#                            S sends ForkQuery(F) on the next connection
#   D never saw F            D: Send(S, ForkUnknown(F)); S.undelivered: F is dropped as if
#                            D had released it (a fork_from_owner fork is unregistered, a
#                            pending child forgotten, a remote() fork ends unusable)
#   D saw F                  nothing: D's own messages about F settle it
#
# D's answer is final: D adopts a new connection only once the old one is closed on its
# side, so a frame from the old one can no longer arrive.
#
# Safety: the owner drops a fork only on its holder's UserDelete, which the holder sends only
# once the fork is registered (confirmed) and every child it handed out is registered too
# (ChildAccepted follows the owner's ForkAccepted for that child). So each live fork is
# registered, or has a live ancestor that is, or descends from a remote() whose creating
# request has not reached the owner yet. That last case is why a ForkRequest (or an own RRef
# coming home) for an unknown RRef creates a *placeholder*: it holds the forks, is never freed
# before new_owner fills it, and is the torch `getOrCreateOwnerRRef` behaviour. Messages that
# name something already gone are late or duplicate deliveries: ignored, never an error.


class RRefId(NamedTuple):
    """Names an RRef: the worker that minted it and a serial unique on that worker."""

    worker: int
    local_id: int


class ForkId(NamedTuple):
    """Names one user fork of an RRef: the worker that minted it and a serial."""

    worker: int
    local_id: int


# -- messages (worker to worker) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RefMessage:
    """A refcount message: it names one fork ``fork_id`` of the RRef ``rref_id``.

    The six kinds below carry nothing else; the kind is the class (equality compares it too).
    """

    rref_id: RRefId
    fork_id: ForkId


@dataclass(frozen=True, slots=True)
class ForkRequest(RefMessage):
    """User to owner: "I hold ``fork_id`` of ``rref_id``, register it"."""


@dataclass(frozen=True, slots=True)
class ForkAccepted(RefMessage):
    """Owner to user: ``fork_id`` is registered (about the reference, not the value)."""


@dataclass(frozen=True, slots=True)
class ChildAccepted(RefMessage):
    """Child holder (or owner) to parent user: the owner knows ``fork_id``; drop your hold."""


@dataclass(frozen=True, slots=True)
class UserDelete(RefMessage):
    """User to owner: ``fork_id`` is gone; unregister it."""


@dataclass(frozen=True, slots=True)
class ForkQuery(RefMessage):
    """Sender of a fork to its receiver, after their connection died: "did ``fork_id``
    reach you?" (answered only when it did not)."""


@dataclass(frozen=True, slots=True)
class ForkUnknown(RefMessage):
    """Receiver to sender: ``fork_id`` never arrived here, and never will."""


Message: TypeAlias = (
    ForkRequest | ForkAccepted | ChildAccepted | UserDelete | ForkQuery | ForkUnknown
)


# -- actions (what the agent must do) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to worker ``dest``."""

    dest: int
    message: Message


@dataclass(frozen=True, slots=True)
class Free:
    """This worker owns ``rref_id`` and nothing references it any more: drop the value.

    May come before the value exists (the holder of a remote() released it early, or its
    caller died): the agent then discards the value when it is produced.
    """

    rref_id: RRefId


@dataclass(frozen=True, slots=True)
class RRefLost:
    """References to ``rref_id`` on this worker can no longer reach a value.

    ``worker`` is the lost worker (the owner, or on the owner the dead caller whose remote()
    never arrived), or this worker's own rank when an own RRef came home after its value was
    already freed (possible only after a peer failure). The agent fails whatever waits on it.
    """

    rref_id: RRefId
    worker: int


@dataclass(frozen=True, slots=True)
class RemoteUndelivered:
    """The remote() request that was to create ``rref_id`` on ``owner`` never arrived:
    the user fork ``fork_id`` made for it is unusable (the agent fails its uses)."""

    rref_id: RRefId
    fork_id: ForkId
    owner: int


Action: TypeAlias = Send | Free | RRefLost | RemoteUndelivered
