"""``one_thread``: torch work the library runs on the loop uses one intra-op thread, and
only on the thread that runs it."""

from __future__ import annotations

import os
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


def _mkl_local() -> int:
    """The calling thread's own MKL thread count (0: none set)."""
    setter = intraop._setter()
    if setter is None:
        pytest.skip("torch has no MKL here")
    now = int(setter(0))
    setter(now)
    return now


def test_one_thread_runs_the_blocks_blas_on_one_thread_and_restores_the_setting() -> None:
    def run() -> tuple[int, int, int, int]:
        before = _mkl_local()
        with one_thread():
            inside = _mkl_local()
        after = _mkl_local()
        intraop._setter()(3)  # a setting of the thread's own is restored as it was
        with one_thread():
            pass
        return before, inside, after, _mkl_local()

    assert _on_a_new_thread(run) == (0, 1, 0, 3)


def test_one_thread_restores_the_setting_when_the_block_raises() -> None:
    def run() -> int:
        with pytest.raises(KeyError), one_thread():
            raise KeyError("x")
        return _mkl_local()

    assert _on_a_new_thread(run) == 0


def test_one_thread_leaves_openmp_and_other_threads_alone() -> None:
    # Changing a thread's OpenMP count regrows its team (a stall in the user's next
    # region); torch.set_num_threads(1) would also change every thread started later.
    default = _on_a_new_thread(torch.get_num_threads)

    def run() -> tuple[int, int, int]:
        with one_thread():
            return (
                torch.get_num_threads(),
                _on_a_new_thread(_mkl_local),
                _on_a_new_thread(torch.get_num_threads),
            )

    assert _on_a_new_thread(run) == (default, 0, default)


def test_keep_team_starts_the_threads_openmp_team() -> None:
    if torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("one intra-op thread, or no OpenMP: no team to start")

    def run() -> set[str]:
        before = set(os.listdir("/proc/self/task"))
        intraop.keep_team()
        return set(os.listdir("/proc/self/task")) - before

    assert _on_a_new_thread(run)  # the team's other threads, started for this thread


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


def test_a_small_pass_on_a_thread_runs_inside_one_thread_a_big_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread waiting in backward() runs hops of its pass: small ones on one thread too.
    monkeypatch.setattr(graph, "one_thread", _Spy)
    _Spy.entered = 0
    y = torch.nn.Linear(8, 4)(torch.randn(3, 8))
    routed, _ = LocalGraph().run([y], [torch.ones_like(y)], dict, 0)
    assert len(routed) == 2
    assert _Spy.entered == 1
    wide = torch.randn(graph.LOOP_PASS_MAX_ELEMENTS + 1, requires_grad=True)
    big = wide * 2
    routed, _ = LocalGraph().run([big], [torch.ones_like(big)], dict, 0)
    assert routed[0][0] is wide
    assert _Spy.entered == 1
