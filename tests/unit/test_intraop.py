"""``one_thread``: torch work the library runs on the loop uses one intra-op thread, and
only on the thread that runs it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncrpc.autograd import graph
from asyncrpc.autograd.graph import LocalGraph
from asyncrpc.runtime import intraop
from asyncrpc.runtime.intraop import one_thread


def _on_a_new_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(timeout=30)
    assert out, "the thread did not finish"
    return out[0]


def _two_threads_here() -> None:
    """Give the calling thread two intra-op threads of its own (as a user's setting would)."""
    knobs = intraop._find_knobs()
    if knobs.omp_set is None:
        pytest.skip("no OpenMP runtime found to set (another platform or parallel backend)")
    torch.get_num_threads()  # torch's own first setting of this thread, out of the way
    knobs.omp_set(2)
    assert torch.get_num_threads() == 2


def test_one_thread_runs_the_block_on_one_thread_and_restores_the_setting() -> None:
    def run() -> tuple[int, int, int]:
        _two_threads_here()
        before = torch.get_num_threads()
        with one_thread():
            inside = torch.get_num_threads()
        return before, inside, torch.get_num_threads()

    assert _on_a_new_thread(run) == (2, 1, 2)


def test_one_thread_restores_the_setting_when_the_block_raises() -> None:
    def run() -> int:
        _two_threads_here()
        with pytest.raises(KeyError), one_thread():
            raise KeyError("x")
        return torch.get_num_threads()

    assert _on_a_new_thread(run) == 2


def test_one_thread_leaves_threads_started_meanwhile_alone() -> None:
    # torch.set_num_threads(1) would make every thread started later single-threaded too.
    default = _on_a_new_thread(torch.get_num_threads)

    def run() -> int:
        _two_threads_here()
        with one_thread():
            return int(_on_a_new_thread(torch.get_num_threads))

    assert _on_a_new_thread(run) == default


class _Spy:
    """Stands in for ``one_thread``: counts the blocks entered."""

    entered = 0

    def __enter__(self) -> None:
        _Spy.entered += 1

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_pass_on_the_loop_runs_inside_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph, "one_thread", _Spy)
    _Spy.entered = 0
    layer = torch.nn.Linear(8, 4)
    y = layer(torch.randn(3, 8))
    assert LocalGraph().run_on_loop([y], [torch.ones_like(y)]) is not None
    assert _Spy.entered == 1
