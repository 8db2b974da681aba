"""Unit tests run without an agent: hide the session worker group's callback loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncrpc.runtime.futures import callbacks


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


@pytest.fixture
def on_device(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Ids of CPU tensors that stand for CUDA tensors: ``is_cpu`` says False for them (the
    CUDA serializer paths on a machine without a GPU)."""
    marked: set[int] = set()
    cpu = torch._C.TensorBase.is_cpu

    def is_cpu(self: torch.Tensor) -> bool:
        return id(self) not in marked and bool(cpu.__get__(self))

    monkeypatch.setattr(torch.Tensor, "is_cpu", property(is_cpu), raising=False)
    return marked
