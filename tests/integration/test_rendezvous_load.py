"""The rendezvous store's load, simulated (``bench/rendezvous.py``): 200 workers, real
store clients against a real TCPStore, join and pass the shutdown barriers in a fixed
number of requests each (the barriers' news travels between the simulation's processes
over queues; tests/integration/test_barrier_news.py runs it over real connections)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import numeric_names, rendezvous

pytestmark = pytest.mark.timeout(300)


def test_numeric_names_answers_reverse_lookups_with_the_address(tmp_path: Path) -> None:
    # The simulation's workers preload it so that torch's reverse lookup of the store's
    # address skips this host's resolver; a caller that demands a name still asks.
    library = numeric_names.build(tmp_path)
    if library is None:
        pytest.skip("no C compiler")
    code = (
        "import socket\n"
        "print(socket.getnameinfo(('127.0.0.1', 80), 0)[0])\n"
        "try:\n"
        "    print(socket.getnameinfo(('127.0.0.1', 80), socket.NI_NAMEREQD)[0])\n"
        "except socket.gaierror:\n"
        "    print('no name')\n"
    )
    env = os.environ | {"LD_PRELOAD": str(library)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    numeric, named = done.stdout.split("\n")[:2]
    assert numeric == "127.0.0.1"
    assert named != "127.0.0.1"  # a name from /etc/hosts or DNS, or none: not forced


def test_200_workers_join_in_at_most_ten_requests_and_barriers_in_two_at_most() -> None:
    row = rendezvous.run(200, spread=2.0, processes=2)
    assert row["workers"] == 200
    assert row["store_listener"] == "ipv4", row  # torch's store on a socket of ours
    assert row["join_requests_max"] <= 10, row
    assert row["join_requests_mean"] <= 9, row
    # Issue 38's bound: at most two store requests per worker per barrier, on average.
    # An arrival is one add; the tree neighbours' addresses one multi_get per shutdown;
    # a worker waiting longer than a slice (0.5 s: shutdown calls come over a second)
    # checks the store once. The rest are the few that complete a barrier or find it
    # open before their message comes (a check of the lost list, an address).
    # The bound is the at 1,000 workers in `python -m bench.rendezvous` (1.5-1.6
    # measured); here, beside the rest of CI on two cores, more workers outwait a slice
    # (2.14 seen once): 2.5 still tells this from the polls it replaced (8 and more).
    assert row["barrier_requests_mean"] <= 2.5, row
    assert row["barrier_requests_max"] <= 5, row  # a worker that waited for a slow one
    by_kind = row["barrier_requests_by_kind"]
    assert by_kind["add"] <= 1.05, by_kind  # one per arrival, and a few full blocks
    assert by_kind["multi_get"] <= 1 / 3, by_kind  # the neighbours, once per shutdown
    # Most workers learn that a barrier opened from a message, not from the store.
    opened = row["barriers_opened"]
    assert sum(opened.values()) == 3 * 200, opened
    assert opened.get("told", 0) >= 0.9 * 3 * 200, opened
