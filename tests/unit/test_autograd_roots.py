"""``RootThreads``: the thread waiting in ``backward()`` runs the hops posted for its pass,
and only while it serves it."""

from __future__ import annotations

import threading

import pytest

from asyncrpc.autograd.roots import RootThreads
from asyncrpc.runtime.futures import Future


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


def test_RootThreads_serve_runs_posted_work_on_the_serving_thread_until_done() -> None:
    roots = RootThreads()
    roots.open(7)
    done: Future[None] = Future()
    ran: list[tuple[str, int]] = []
    assert roots.post(7, lambda: ran.append(("first", threading.get_ident())))
    assert roots.post(
        7, lambda: (ran.append(("second", threading.get_ident())), done.set_result(None))
    )
    roots.serve(7, done)
    assert ran == [("first", threading.get_ident()), ("second", threading.get_ident())]
    assert roots.hops_taken == 2


def test_RootThreads_work_from_another_thread_wakes_the_server() -> None:
    roots = RootThreads()
    roots.open(1)
    done: Future[None] = Future()
    ran: list[int] = []

    def post_later() -> None:
        assert roots.post(1, lambda: ran.append(threading.get_ident()))
        done.set_result(None)

    poster = threading.Thread(target=post_later)
    poster.start()
    roots.serve(1, done)
    poster.join(10)
    assert ran == [threading.get_ident()]  # posted before done: run before serve returns


def test_RootThreads_stops_taking_work_once_serve_returns() -> None:
    roots = RootThreads()
    roots.open(3)
    roots.serve(3, _done())
    assert not roots.post(3, lambda: None)  # the caller runs it elsewhere
    assert roots.hops_taken == 0


def test_RootThreads_post_before_open_or_after_close_is_refused() -> None:
    roots = RootThreads()
    assert not roots.post(5, lambda: None)
    roots.open(5)
    roots.close(5)
    assert not roots.post(5, lambda: None)


def test_RootThreads_work_posted_after_done_still_runs_before_serve_returns() -> None:
    roots = RootThreads()
    roots.open(2)
    done: Future[None] = Future()
    ran: list[str] = []

    def finish_then_post() -> None:
        done.set_result(None)  # the stop mark goes in first
        assert roots.post(2, lambda: ran.append("late"))  # still open: the thread runs it

    assert roots.post(2, finish_then_post)
    roots.serve(2, done)
    assert ran == ["late"]
    assert not roots.post(2, lambda: None)


def test_RootThreads_interrupted_serve_closes_and_runs_what_was_posted() -> None:
    roots = RootThreads()
    roots.open(4)
    ran: list[str] = []

    def interrupt() -> None:
        assert roots.post(4, lambda: ran.append("posted meanwhile"))
        raise KeyboardInterrupt

    assert roots.post(4, interrupt)
    with pytest.raises(KeyboardInterrupt):
        roots.serve(4, Future())
    assert ran == ["posted meanwhile"]
    assert not roots.post(4, lambda: None)


def test_RootThreads_refuses_work_while_the_thread_is_away_then_takes_it_again() -> None:
    # The thread blocked in a lane call serves nothing: a hop back here must run elsewhere.
    roots = RootThreads()
    roots.open(8)
    ran: list[str] = []
    box = roots.away(8)
    assert not roots.post(8, lambda: ran.append("while away"))
    roots.back(8, box)
    assert roots.post(8, lambda: ran.append("back"))
    roots.serve(8, _done())
    assert ran == ["back"]


def test_RootThreads_finish_runs_what_was_posted_and_takes_no_more() -> None:
    roots = RootThreads()
    roots.open(9)
    ran: list[str] = []
    assert roots.post(9, lambda: ran.append("posted"))
    roots.finish(9)
    assert ran == ["posted"]
    assert not roots.post(9, lambda: ran.append("late"))
