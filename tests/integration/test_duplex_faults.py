"""Client and bidirectional streams whose peer dies or shuts down mid-stream, each in a
group of its own: the test starts w1 and a scenario driver (``tests/scenarios/duplex.py``)
and kills w1 when told."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.stream_peer import run_with_w1

pytestmark = pytest.mark.timeout(150)


def test_bidi_killed_callee_ends_the_replies_with_peer_lost(tmp_path: Path) -> None:
    obs, codes = run_with_w1("bidi_killed_callee", tmp_path, kill=True)
    assert obs["stdin"] == "KILLED"
    assert obs["replies"] == [2 * i for i in range(10)]
    assert obs["error"] is not None, obs
    assert obs["error"]["type"] == "PeerLostError", obs
    assert obs["error"]["worker"] == "w1"
    assert obs["send_after"]["error"]["type"] == "PeerLostError", obs  # the stream's error
    assert obs["clean"] is True
    assert codes == [-signal.SIGKILL]


def test_stream_arg_killed_callee_fails_the_call_and_closes_the_source(tmp_path: Path) -> None:
    obs, codes = run_with_w1("stream_arg_killed_callee", tmp_path, kill=True)
    assert obs["streaming"] is True
    assert obs["call"]["error"]["type"] == "PeerLostError", obs
    assert obs["finally_ran"] is True
    assert obs["clean"] is True
    assert codes == [-signal.SIGKILL]


def test_bidi_killed_caller_closes_the_callees_function(tmp_path: Path) -> None:
    # As a stream's producer whose consumer dies is closed, and a call whose caller dies
    # is cancelled: the callee's function stops where it waits.
    obs, codes = run_with_w1("bidi_killed_caller", tmp_path, kill=True)
    assert obs["streaming"] is True
    assert obs["ended"] in ("CancelledError", "GeneratorExit"), obs
    assert obs["clean"] is True
    assert codes == [-signal.SIGKILL]


def test_bidi_graceful_shutdown_closes_it(tmp_path: Path) -> None:
    obs, codes = run_with_w1("bidi_shutdown", tmp_path, kill=False)
    assert obs["first"] == [0, 2, 4, 6, 8]
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert obs["rest"]["error"]["type"] == "ClosedError", obs["rest"]
    assert obs["send_after"]["error"]["type"] == "ClosedError", obs
    assert codes == [0]


def test_stream_arg_callee_in_graceful_shutdown_reads_it_to_the_end(tmp_path: Path) -> None:
    obs, codes = run_with_w1("callee_shutdown_reads_on", tmp_path, kill=False)
    assert obs["reading"] is True
    assert obs["shutdown"]["error"] is None, obs
    assert obs["ended"] == "end", obs
    assert obs["seen"] == list(range(100))
    assert obs["call"]["value"] == 100, obs
    assert codes == [0]


def test_stream_arg_read_late_is_still_held_for_its_callee(tmp_path: Path) -> None:
    obs, codes = run_with_w1("late_reader", tmp_path, kill=False)
    assert obs["late"]["error"] is None, obs
    assert obs["late"]["value"] == sum(range(100))
    assert obs["held"] == 0
    assert codes == [0]


def test_stream_arg_held_unread_by_a_killed_callee_is_closed(tmp_path: Path) -> None:
    obs, codes = run_with_w1("stream_arg_killed_before_reading", tmp_path, kill=True)
    assert obs["claimed"] is True
    assert obs["call"]["error"]["type"] == "PeerLostError", obs
    assert obs["released"] is True, obs
    assert obs["source_closed"] is True
    assert codes == [-signal.SIGKILL]
