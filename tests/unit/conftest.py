"""Unit tests run without an agent: hide the session worker group's callback loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrpc.runtime import callbacks


@pytest.fixture(autouse=True)
def _no_agent_callback_loop() -> Iterator[None]:
    # The integration group (a session fixture) may have registered its agent's loop;
    # unit tests describe futures with no agent at all.
    saved = callbacks._default_loop, callbacks._default_thread
    callbacks.set_default_callback_loop(None, None)
    try:
        yield
    finally:
        callbacks.set_default_callback_loop(*saved)
