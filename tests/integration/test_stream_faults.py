"""Streams whose peer dies or shuts down mid-stream, each in a group of its own: the test
starts w1 and a scenario driver (``tests/scenarios/stream.py``) and kills w1 when told."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.stream_peer import run_with_w1

pytestmark = pytest.mark.timeout(120)


def test_stream_killed_producer_ends_the_stream_with_peer_lost(tmp_path: Path) -> None:
    obs, codes = run_with_w1("killed_producer", tmp_path, kill=True)
    assert obs["stdin"] == "KILLED"
    assert obs["error"] is not None, obs
    assert obs["error"]["type"] == "PeerLostError"
    assert obs["error"]["worker"] == "w1"
    assert obs["in_order"] is True
    assert 20 <= obs["count"] <= 20 + 8  # at most a window past what was taken
    assert obs["later"]["error"]["type"] == "PeerLostError"
    assert obs["consuming_after"] == 0
    assert codes == [-signal.SIGKILL]


def test_stream_killed_consumer_stops_the_producer(tmp_path: Path) -> None:
    obs, _ = run_with_w1("killed_consumer", tmp_path, kill=True)
    assert obs["w1_in_shutdown"] is True
    assert obs["producing"] is True
    assert obs["consumer_call"]["error"]["type"] == "PeerLostError"
    assert obs["finally_ran"] is True
    assert obs["producing_after"] is True


def test_stream_a_producer_in_graceful_shutdown_serves_its_stream_to_the_end(
    tmp_path: Path,
) -> None:
    # The worker that produces calls shutdown mid-stream: it reads no more, but the
    # stream it serves is its consumer's, which reads all of it before the barrier ends.
    obs, codes = run_with_w1("producer_shutdown", tmp_path, kill=False)
    assert obs["w1_in_shutdown"] is True
    assert obs["started"] is True
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert obs["consumed"]["error"] is None, obs["consumed"]
    assert obs["consumed"]["value"] == list(range(40))
    assert obs["produced"] == 40
    assert codes == [0]


def test_stream_graceful_shutdown_closes_open_streams(tmp_path: Path) -> None:
    obs, codes = run_with_w1("shutdown_mid_stream", tmp_path, kill=False)
    assert obs["first"] == [0, 1, 2, 3, 4]
    assert obs["shutdown"]["error"] is None, obs["shutdown"]
    assert obs["rest"]["error"] is not None, obs["rest"]
    assert obs["rest"]["error"]["type"] == "ClosedError", obs["rest"]
    assert codes == [0]
