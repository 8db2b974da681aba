"""CUDA IPC for stream items between real worker processes over 127.0.0.1, in the fake
CUDA world of ``cuda_world.py`` with its file-backed IPC (blocks are files both processes
open; a fill lands only once it has run): after two calls probed each way, a server
stream's items go by handle, whole and in order (a frame that left before its fill ran
would bring zeros), every block comes back to the producer through the stream's own
frames (no call flows back), and a stalled consumer stops the producer at its byte
window."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.cuda_run import observe
from tests.integration.cuda_world import NBYTES
from tests.scenarios.cuda import M

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = {"IPC_DIR": str(tmp_path_factory.mktemp("ipc_blocks")), "IPC_MODE": "auto"}
    result: dict[str, Any] = observe(
        "cuda_ipc_items", tmp_path_factory.mktemp("cuda_ipc_items"), env
    )
    return result


def test_server_stream_items_go_by_handle_whole_and_in_order(observed: dict[str, Any]) -> None:
    assert observed["server"] == [[i, True, NBYTES] for i in range(M)]
    assert observed["w1"]["cuda_ipc_shared"] >= M  # each item's tensor by handle
    assert observed["opened"] >= M  # and each opened here, none staged


def test_every_block_comes_back_through_the_streams_frames(observed: dict[str, Any]) -> None:
    assert observed["owed"] == 0  # before any call flowed back
    assert observed["named_back"] >= observed["opened"]
    assert observed["w1"]["lent"] == 0
    assert observed["w1"]["cuda_ipc_released"] >= M


def test_a_stalled_consumer_stops_the_producer_at_its_byte_window(
    observed: dict[str, Any],
) -> None:
    stalled = observed["stalled"]
    made = stalled["made"]
    assert 1 <= made <= 5  # four items' bytes, and the one that passed the window
    assert stalled["lent"] <= made
