"""CUDA tensors in stream items between real worker processes over 127.0.0.1, in a fake
CUDA world (``cuda_world.py``: marked CPU tensors, a GPU whose device 0 is slow): each item's
frame leaves only once its staged copy ran (else it would bring zeros), items arrive in order
although a later item's copy finished first, each lands on the device the map names, and the
reading thread's own streams wait for each item's copy. A server stream (the reply's map), a
client stream (the sender's own map) and a bidirectional stream."""

from __future__ import annotations

import pytest

from tests.integration.cuda_run import observe
from tests.integration.cuda_world import NBYTES

pytestmark = pytest.mark.timeout(120)

N = 6


def _whole(values: list[int]) -> list[list[object]]:
    return [[v, True, NBYTES] for v in values]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    result: dict[str, object] = observe("cuda_items", tmp_path_factory.mktemp("cuda_items"))
    return result


def test_server_stream_items_leave_after_their_copies_in_order(observed: dict[str, object]) -> None:
    assert observed["server"] == _whole(list(range(N)))  # whole, in order
    landed = observed["w1_after_server"]["landed"]  # type: ignore[index]
    assert sorted(landed) == list(range(N))
    assert landed != sorted(landed)  # a later item's copy (fast device 1) ran first
    assert observed["server_arrived"] == [1, 0] * (N // 2)  # the reply's map: 0->1, 1->0
    assert observed["server_waits"] == [N // 2, N // 2]  # each read waited for its copy


def test_client_stream_items_follow_the_senders_map(observed: dict[str, object]) -> None:
    client = observed["client"]
    assert client["items"] == _whole(list(range(N)))  # type: ignore[index]
    assert client["waits"] == [N // 2, N // 2]  # type: ignore[index]
    assert observed["w1_after_client"]["arrived"][-N:] == [1, 0] * (N // 2)  # type: ignore[index]
    landed = observed["client_landed"]
    assert sorted(landed) == list(range(N))  # type: ignore[arg-type]
    assert landed != sorted(landed)  # type: ignore[type-var]


def test_bidi_items_both_ways(observed: dict[str, object]) -> None:
    assert observed["bidi"] == _whole([2 * i for i in range(N)])
    assert observed["bidi_arrived"] == [1] * N  # echoed from w1's device 0: the reply's map
    assert observed["bidi_waits"] == [0, N]
    assert sorted(observed["bidi_landed"]) == list(range(N))  # type: ignore[arg-type]
