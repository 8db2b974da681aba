"""The one place code finds the current agent and its features (layer L2.5).

The public API (``asyncrpc/api.py``) reads the agent itself; everything else reaches a
feature of it through a ``FeatureSlot``, declared by the code that uses the feature, as
trio's ``RunVar`` scopes state to a run instead of a module: the remote functions of
distributed autograd find its contexts, an RRef handle the RRef operations, the server
profiler its hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar, cast

from asyncrpc.errors import InitError, NotInitializedError

if TYPE_CHECKING:
    from asyncrpc.runtime.agent import Agent

__all__ = ["FeatureSlot", "clear_agent", "current_agent", "set_agent"]

F = TypeVar("F")

_agent: Agent | None = None


def current_agent() -> Agent:
    """Return the running agent of this process.

    Raises:
        NotInitializedError: ``init_rpc`` has not been called, or ``shutdown`` has.
    """
    if _agent is None:
        raise NotInitializedError(
            "RPC has not been initialized: call asyncrpc.init_rpc() first "
            "(Current RPC agent is not set! Did you initialize the RPC framework?)"
        )
    return _agent


def set_agent(agent: Agent) -> None:
    global _agent
    if _agent is not None:
        raise InitError(
            f"this process already runs worker {_agent.group.name!r}; call shutdown() first"
        )
    _agent = agent


def clear_agent(agent: Agent) -> None:
    global _agent
    if _agent is agent:
        _agent = None


class FeatureSlot(Generic[F]):
    """The feature of the current agent named ``name``, as type ``F`` (its declarer's view).

    Args:
        name: the feature's ``Feature.name``.
        what: how errors name it ("distributed autograd").
    """

    __slots__ = ("name", "what")

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what

    def get(self) -> F:
        """The current agent's feature.

        Raises:
            NotInitializedError: no worker runs in this process, or it runs without it.
        """
        feature = current_agent().feature(self.name)
        if feature is None:
            raise NotInitializedError(f"this worker was started without {self.what}")
        # The agent holds features by name; the slot's declarer says which type it is.
        return cast(F, feature)
