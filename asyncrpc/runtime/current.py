"""The one place module-level API functions find the current agent (layer L2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrpc.errors import InitError, NotInitializedError

if TYPE_CHECKING:
    from asyncrpc.runtime.agent import Agent

__all__ = ["clear_agent", "current_agent", "set_agent"]

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
        raise InitError(f"this process already runs worker {_agent.name!r}; call shutdown() first")
    _agent = agent


def clear_agent(agent: Agent) -> None:
    global _agent
    if _agent is agent:
        _agent = None
