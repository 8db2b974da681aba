"""Single-process asyncio tests run without an agent, like the unit tests."""

from __future__ import annotations

from tests.unit.conftest import _no_agent_callback_loop

__all__ = ["_no_agent_callback_loop"]  # an autouse fixture, active here by being imported
