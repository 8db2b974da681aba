"""The deadline bookkeeping of a served request (``asyncrpc.runtime.calls.deadline``)."""

from __future__ import annotations

import threading
import time

import asyncrpc
from asyncrpc.runtime.calls.deadline import (
    deadline_after,
    expired,
    inherited,
    running_until,
    time_remaining,
)


def test_a_request_without_a_timeout_has_no_deadline() -> None:
    assert deadline_after(0) is None
    assert deadline_after(-1) is None
    assert not expired(None)
    assert deadline_after(2.0, now=10.0) == 12.0
    assert expired(time.monotonic() - 0.001)


def test_time_remaining_is_the_served_request_s_and_only_while_it_is_served() -> None:
    assert asyncrpc.time_remaining is time_remaining
    assert time_remaining() is None
    with running_until(time.monotonic() + 5.0):
        left = time_remaining()
        assert left is not None
        assert 4.9 < left <= 5.0
        seen: list[float | None] = []
        other = threading.Thread(target=lambda: seen.append(time_remaining()))
        other.start()
        other.join(5)
        assert seen == [None]  # per thread: another thread serves nothing
        with running_until(None):  # a request without a deadline, served inside
            assert time_remaining() is None
        assert time_remaining() is not None
    assert time_remaining() is None
    with running_until(time.monotonic() - 1.0):
        assert time_remaining() == 0.0


def test_a_nested_call_takes_the_shorter_of_its_timeout_and_what_is_left() -> None:
    assert inherited(7.0) == 7.0  # nothing served: its own
    assert inherited(0.0) == 0.0
    with running_until(time.monotonic() + 5.0):
        assert 4.9 < inherited(0.0) <= 5.0  # none of its own: the rest of the budget
        assert 4.9 < inherited(60.0) <= 5.0
        assert inherited(2.0) == 2.0
    with running_until(time.monotonic() - 1.0):
        assert inherited(0.0) == 1e-3  # spent: fails as a timeout, never as "no timeout"
