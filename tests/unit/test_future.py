"""Unit tests of asyncrpc.runtime.futures with no event loop: completion, waiting, chaining."""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from asyncrpc.errors import AsyncRpcError
from asyncrpc.runtime.futures import (
    Future,
    FutureAlreadyDoneError,
    FutureNotDoneError,
    collect_all,
    on_cancel,
    try_set_exception,
    try_set_result,
    wait_all,
)
from tests.ordering import in_function, until

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch


def _complete_when(
    fut: Future[Any], value: object, ready: Callable[[], bool] = lambda: True
) -> threading.Thread:
    """Complete ``fut`` from a new thread once ``ready()`` holds (polled, bounded)."""

    def run() -> None:
        until(ready, what="the waiter to block")
        fut.set_result(value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _blocked_in(name: str, thread: int | None = None) -> Callable[[], bool]:
    """Whether ``thread`` (this one by default) is inside function ``name`` right now."""
    ident = threading.get_ident() if thread is None else thread
    return lambda: in_function(ident, name)


def _append(out: list[Any], item: object, _fut: object) -> None:
    out.append(item)


class BoomError(Exception):
    """A test-only error, so that no library error can be mistaken for it."""


# -- completion and inspection -----------------------------------------------------------------


def test_Future_set_result_makes_it_done_with_value() -> None:
    fut: Future[int] = Future()
    assert not fut.done()
    fut.set_result(3)
    assert fut.done()
    assert fut.value() == 3
    assert fut.wait() == 3
    assert fut.result() == 3
    assert fut.exception() is None


def test_Future_set_exception_raises_from_value_and_wait() -> None:
    fut: Future[int] = Future()
    err = BoomError("boom")
    fut.set_exception(err)
    assert fut.done()
    with pytest.raises(BoomError) as info:
        fut.value()
    assert info.value is err
    with pytest.raises(BoomError):
        fut.wait()
    assert fut.exception() is err


def test_Future_repeated_raise_does_not_grow_traceback() -> None:
    fut: Future[int] = Future()
    fut.set_exception(ValueError("boom"))
    depths = []
    for _ in range(3):
        try:
            fut.value()
        except ValueError as exc:
            tb, depth = exc.__traceback__, 0
            while tb is not None:
                depth, tb = depth + 1, tb.tb_next
            depths.append(depth)
    assert depths[0] == depths[1] == depths[2]


def test_Future_set_exception_rejects_non_exception() -> None:
    fut: Future[int] = Future()
    with pytest.raises(TypeError):
        fut.set_exception("nope")  # type: ignore[arg-type]
    assert not fut.done()


def test_Future_double_completion_raises() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    with pytest.raises(FutureAlreadyDoneError):
        fut.set_result(2)
    with pytest.raises(FutureAlreadyDoneError):
        fut.set_exception(ValueError())
    assert fut.value() == 1
    assert isinstance(FutureAlreadyDoneError(), AsyncRpcError | RuntimeError)


def test_Future_value_and_exception_when_not_done_raise() -> None:
    fut: Future[int] = Future()
    with pytest.raises(FutureNotDoneError):
        fut.value()
    with pytest.raises(FutureNotDoneError):
        fut.exception()
    assert isinstance(FutureNotDoneError(), RuntimeError)


def test_Future_errors_pickle() -> None:
    for cls in (FutureNotDoneError, FutureAlreadyDoneError):
        err = pickle.loads(pickle.dumps(cls("detail")))
        assert type(err) is cls
        assert err.args == ("detail",)


def test_Future_wait_timeout_raises_builtin_timeout_and_stays_pending() -> None:
    fut: Future[int] = Future()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        fut.wait(0.05)
    assert time.monotonic() - start >= 0.04
    assert not fut.done()
    fut.set_result(5)
    assert fut.wait(0.05) == 5


def test_Future_wait_returns_when_completed_from_another_thread() -> None:
    fut: Future[str] = Future()
    thread = _complete_when(fut, "x", _blocked_in("_block"))  # once this thread waits
    assert fut.wait(5) == "x"
    thread.join()


def test_Future_many_threads_wait_on_one_future() -> None:
    fut: Future[int] = Future()
    got: list[int] = []
    lock = threading.Lock()

    def waiter() -> None:
        value = fut.wait(5)
        with lock:
            got.append(value)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for thread in threads:
        thread.start()
    # Every waiter is blocked in the future's wait before it completes.
    until(lambda: all(in_function(t.ident or 0, "_block") for t in threads))
    fut.set_result(7)
    for thread in threads:
        thread.join(5)
    assert got == [7] * 8


def test_Future_cancel_completes_with_cancelled_error_and_runs_hook() -> None:
    fut: Future[int] = Future()
    calls: list[str] = []
    on_cancel(fut, lambda: calls.append("hook"))
    assert fut.cancel() is True
    assert calls == ["hook"]
    assert isinstance(fut.exception(), asyncio.CancelledError)
    with pytest.raises(asyncio.CancelledError):
        fut.wait()
    assert fut.cancel() is False
    assert calls == ["hook"]


def test_Future_cancel_of_done_future_returns_false() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    assert fut.cancel() is False
    assert fut.value() == 1


def test_Future_try_set_is_silent_after_cancel() -> None:
    fut: Future[int] = Future()
    fut.cancel()
    assert try_set_result(fut, 1) is False
    assert try_set_exception(fut, ValueError()) is False
    assert isinstance(fut.exception(), asyncio.CancelledError)


# -- callbacks without a loop -----------------------------------------------------------------


def test_Future_callbacks_run_without_loop_in_completing_thread() -> None:
    fut: Future[int] = Future()
    seen: list[tuple[int, int]] = []
    fut.add_done_callback(lambda f: seen.append((f.value(), threading.get_ident())))
    thread = _complete_when(fut, 4)
    thread.join()
    assert seen == [(4, thread.ident)]


def test_Future_callback_added_after_done_runs_without_loop() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    seen: list[int] = []
    fut.add_done_callback(lambda f: seen.append(f.value()))
    assert seen == [1]


def test_Future_hundred_callbacks_run_in_registration_order() -> None:
    fut: Future[int] = Future()
    order: list[int] = []
    for i in range(50):
        fut.add_done_callback(partial(_append, order, i))
    fut.set_result(0)
    for i in range(50, 100):
        fut.add_done_callback(partial(_append, order, i))
    assert order == list(range(100))


def test_Future_callback_added_from_callback_runs_after_the_others() -> None:
    fut: Future[int] = Future()
    order: list[str] = []
    fut.add_done_callback(lambda f: f.add_done_callback(lambda _: order.append("nested")))
    fut.add_done_callback(lambda _: order.append("second"))
    fut.set_result(0)
    assert order == ["second", "nested"]


def test_Future_callback_exception_is_logged_and_swallowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fut: Future[int] = Future()
    seen: list[int] = []

    def bad(_: Future[int]) -> None:
        raise ValueError("callback bug")

    fut.add_done_callback(bad)
    fut.add_done_callback(lambda f: seen.append(f.value()))
    with caplog.at_level(logging.ERROR, logger="asyncrpc.runtime.futures.core"):
        fut.set_result(2)
    assert seen == [2]
    assert any(r.exc_info and r.exc_info[0] is ValueError for r in caplog.records)


# -- then ----------------------------------------------------------------------------------


def test_Future_then_chains_values() -> None:
    fut: Future[int] = Future()
    chained = fut.then(lambda f: f.value() + 1).then(lambda f: f.value() * 10)
    assert isinstance(chained, Future)
    fut.set_result(1)
    assert chained.wait(1) == 20


def test_Future_then_callback_raising_fails_the_new_future() -> None:
    fut: Future[int] = Future()

    def bad(_: Future[int]) -> int:
        raise KeyError("k")

    chained = fut.then(bad)
    fut.set_result(1)
    exc = chained.exception()
    assert isinstance(exc, KeyError)
    assert isinstance(exc, RuntimeError)  # as torch reports a callback's error
    assert isinstance(exc.__cause__, KeyError)


def test_Future_then_propagates_parent_exception_through_value() -> None:
    fut: Future[int] = Future()
    chained = fut.then(lambda f: f.value())
    fut.set_exception(ValueError("parent"))
    assert isinstance(chained.exception(), ValueError)


def test_Future_then_returning_future_is_flattened() -> None:
    fut: Future[int] = Future()
    inner: Future[str] = Future()
    chained = fut.then(lambda _: inner)
    fut.set_result(1)
    assert not chained.done()
    inner.set_result("inner")
    assert chained.wait(1) == "inner"


def test_Future_then_returning_failed_future_is_flattened() -> None:
    fut: Future[int] = Future()
    inner: Future[str] = Future()
    inner.set_exception(OSError("inner"))
    chained = fut.then(lambda _: inner)
    fut.set_result(1)
    assert isinstance(chained.exception(), OSError)


def test_Future_then_returning_torch_future_is_flattened() -> None:
    fut: Future[int] = Future()
    inner: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    chained = fut.then(lambda _: inner)
    fut.set_result(1)
    assert not chained.done()
    inner.set_result(torch.ones(2))
    assert torch.equal(chained.wait(1), torch.ones(2))


def test_Future_then_returning_coroutine_without_loop_fails_cleanly() -> None:
    async def coro() -> int:
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut: Future[int] = Future()
        chained = fut.then(lambda _: coro())
        fut.set_result(1)
        assert isinstance(chained.exception(), AsyncRpcError)
        del fut, chained
        gc.collect()  # the coroutine was closed, not left to warn when collected
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


# -- collect_all / wait_all ------------------------------------------------------------------------


def test_collect_all_completes_with_all_futures_and_never_fails() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    tb: torch.futures.Future[int] = torch.futures.Future()
    together = collect_all([a, b, tb])
    a.set_exception(ValueError("a"))
    b.set_result(2)
    assert not together.done()
    tb.set_result(3)
    futures = together.wait(1)
    assert all(isinstance(f, Future) for f in futures)
    assert futures[0] is a
    assert futures[1] is b
    assert isinstance(futures[0].exception(), ValueError)
    assert futures[2].value() == 3


def test_collect_all_of_nothing_is_done() -> None:
    assert collect_all([]).wait(0) == []


def test_wait_all_returns_values_in_order() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    thread = _complete_when(b, 2, _blocked_in("_first_failure"))  # once wait_all waits
    a.set_result(1)
    tf: torch.futures.Future[int] = torch.futures.Future()
    tf.set_result(3)
    assert wait_all([a, b, tf]) == [1, 2, 3]
    thread.join()


def test_wait_all_raises_the_first_failure_without_waiting_for_the_rest() -> None:
    # torch.futures.wait_all's rule over torch's RPC futures.
    a: Future[int] = Future()
    b: Future[int] = Future()
    c: Future[int] = Future()
    waiting = _blocked_in("_first_failure")
    failer = threading.Thread(target=lambda: (until(waiting), b.set_exception(BoomError("b"))))
    failer.start()
    with pytest.raises(BoomError):
        wait_all([a, b, c])
    failer.join()
    assert not a.done()
    assert not c.done()
    assert a._hooks in (None, [])  # the wait left nothing behind on the futures still pending
    a.set_result(1)
    c.set_result(3)


def test_wait_all_raises_the_first_failed_in_list_order_when_some_failed_already() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    c: Future[int] = Future()
    c.set_exception(KeyError("c"))
    b.set_exception(BoomError("b"))
    with pytest.raises(BoomError):
        wait_all([a, b, c])
    assert not a.done()


def test_wait_all_waits_for_all_when_none_fails() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    waiting = _blocked_in("_first_failure")
    # a, then b, both once wait_all waits.
    threads = [_complete_when(a, 1, waiting), _complete_when(b, 2, lambda: waiting() and a.done())]
    assert wait_all([a, b]) == [1, 2]
    for thread in threads:
        thread.join()


# -- torch bridges -------------------------------------------------------------------------


def test_Future_from_torch_copies_result_and_error() -> None:
    tf: torch.futures.Future[int] = torch.futures.Future()
    ours = Future.from_torch(tf)
    assert not ours.done()
    tf.set_result(5)
    assert ours.wait(1) == 5
    tf2: torch.futures.Future[Any] = torch.futures.Future()
    tf2.set_exception(ValueError("t"))
    assert isinstance(Future.from_torch(tf2).exception(), ValueError)


def test_Future_to_torch_copies_result_and_error() -> None:
    ours: Future[int] = Future()
    tf = ours.to_torch()
    assert isinstance(tf, torch.futures.Future)
    assert not tf.done()
    ours.set_result(6)
    assert tf.wait() == 6
    failing: Future[int] = Future()
    tf2 = failing.to_torch()
    failing.set_exception(BoomError("o"))
    with pytest.raises(BoomError):
        tf2.wait()


def test_Future_to_torch_of_cancelled_future_fails_with_runtime_error() -> None:
    ours: Future[int] = Future()
    tf = ours.to_torch()
    ours.cancel()
    with pytest.raises(RuntimeError):
        tf.wait()


def test_Future_round_trip_through_torch_then() -> None:
    ours: Future[int] = Future()
    back = Future.from_torch(ours.to_torch().then(lambda t: t.value() + 1))
    ours.set_result(1)
    assert back.wait(1) == 2


def test_Future_wrap_accepts_each_kind() -> None:
    ours: Future[int] = Future()
    assert Future.wrap(ours) is ours
    tf: torch.futures.Future[int] = torch.futures.Future()
    tf.set_result(1)
    assert Future.wrap(tf).value() == 1
    with pytest.raises(TypeError):
        Future.wrap(42)


def test_Future_wrap_concurrent_future_and_cancel_it() -> None:
    import concurrent.futures

    cf: concurrent.futures.Future[int] = concurrent.futures.Future()
    ours = Future.wrap(cf)
    cf.set_result(9)
    assert ours.wait(1) == 9
    cf2: concurrent.futures.Future[int] = concurrent.futures.Future()
    ours2 = Future.wrap(cf2)
    assert ours2.cancel()
    assert cf2.cancelled()


def test_Future_wrap_coroutine_without_loop_raises_and_closes_it() -> None:
    async def coro() -> int:
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AsyncRpcError):
            Future.wrap(coro())
        gc.collect()  # a coroutine that was never closed warns when it is collected
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_Future_await_of_done_future_needs_no_loop() -> None:
    fut: Future[int] = Future()
    fut.set_result(12)
    with pytest.raises(StopIteration) as info:
        fut.__await__().send(None)
    assert info.value.value == 12


def test_Future_racing_completers_exactly_one_wins() -> None:
    def complete(fut: Future[int], barrier: threading.Barrier, i: int, wins: list[int]) -> None:
        barrier.wait(5)
        if try_set_result(fut, i):
            wins.append(i)

    for _ in range(50):
        fut: Future[int] = Future()
        wins: list[int] = []
        barrier = threading.Barrier(4)
        threads = [
            threading.Thread(target=complete, args=(fut, barrier, i, wins)) for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert len(wins) == 1
        assert fut.value() == wins[0]


def test_Future_callbacks_added_while_completing_each_run_once() -> None:
    lock = threading.Lock()

    def bump(counts: list[int], i: int, _fut: object) -> None:
        with lock:
            counts[i] += 1

    def adder(fut: Future[int], counts: list[int], start: int) -> None:
        for i in range(start, start + 100):
            fut.add_done_callback(partial(bump, counts, i))

    for _ in range(20):
        fut: Future[int] = Future()
        counts = [0] * 400
        threads = [threading.Thread(target=adder, args=(fut, counts, k * 100)) for k in range(4)]
        for thread in threads:
            thread.start()
        fut.set_result(0)
        for thread in threads:
            thread.join(5)
        assert counts == [1] * 400


# -- torch interoperability ---------------------------------------------------------------------


def test_Future_is_a_torch_future() -> None:
    assert isinstance(Future(), torch.futures.Future)


def test_Future_works_with_torch_wait_all() -> None:
    futs: list[Future[int]] = [Future() for _ in range(3)]
    waiting = _blocked_in("wait_all")  # torch's, which blocks in C++ below this frame
    # In list order, each once torch's wait_all was entered and the one before is done.
    threads = [
        _complete_when(f, i, lambda i=i: waiting() and (i == 0 or futs[i - 1].done()))
        for i, f in enumerate(futs)
    ]
    assert torch.futures.wait_all(futs) == [0, 1, 2]
    for thread in threads:
        thread.join()


def test_Future_error_raises_from_torch_wait_all() -> None:
    ok: Future[int] = Future()
    ok.set_result(1)
    bad: Future[int] = Future()
    bad.set_exception(BoomError("boom"))
    with pytest.raises(BoomError, match="boom"):
        torch.futures.wait_all([ok, bad])


def test_Future_works_with_torch_collect_all() -> None:
    futs: list[Future[int]] = [Future() for _ in range(2)]
    collected = torch.futures.collect_all(futs)
    assert not collected.done()
    futs[0].set_result(5)
    futs[1].set_result(6)
    assert [f.wait() for f in collected.wait()] == [5, 6]


def test_Future_pickling_is_refused_like_torch() -> None:
    fut: Future[int] = Future()
    with pytest.raises(RuntimeError, match=r"Can not pickle torch\.futures\.Future"):
        pickle.dumps(fut)


@pytest.mark.parametrize("register", ["then", "add_done_callback"])
def test_Future_non_callable_callback_is_a_type_error(register: str) -> None:
    fut: Future[int] = Future()
    with pytest.raises(TypeError):
        getattr(fut, register)(None)


def test_Future_failed_with_an_exception_referring_to_it_is_collected() -> None:
    # The exception leads back to the future (as tracebacks do through frames): C++ must not
    # hold the exception, or the garbage collector could never free the pair.
    fut: Future[int] = Future()
    fut.set_exception(BoomError(fut))
    ref = weakref.ref(fut)
    del fut
    gc.collect()
    assert ref() is None
