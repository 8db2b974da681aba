"""The rendezvous store's load, simulated (``bench/rendezvous.py``): 200 workers, real
store clients against a real TCPStore, join and pass the shutdown barriers in a fixed
number of requests each."""

from __future__ import annotations

import pytest

from bench import rendezvous

pytestmark = pytest.mark.timeout(300)


def test_200_workers_join_in_at_most_ten_requests_and_barriers_in_two() -> None:
    row = rendezvous.run(200, spread=2.0, processes=2)
    assert row["workers"] == 200
    assert row["join_requests_max"] <= 10, row
    assert row["join_requests_mean"] <= 9, row
    assert row["barrier_requests_max"] <= 3, row  # a slow barrier adds a slice
    assert row["barrier_requests_mean"] <= 2.5, row  # arrivals over a second: a slice more
