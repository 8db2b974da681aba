"""Large tensors between workers on one host travel through shared memory (issue 13).

The shared group's driver (this process) and its workers are all on this host, so every
large tensor below goes through a memfd chunk rather than the socket once the peers have
probed each other. Separate groups cover a full arena, the option turned off, and a
SIGKILL of either side.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group
from tests.scenarios.common import poll

pytestmark = pytest.mark.timeout(120)

MIB_FLOATS = 1 << 18


def _shm(metrics: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in metrics.items() if k.startswith("shm_")}


def _wait(condition: Any, timeout: float = 10.0) -> bool:
    return poll(condition, timeout)


@pytest.fixture
def sharing(group: Group) -> None:
    """Both directions between the driver and w1, w2 have probed and share memory."""
    big = torch.ones(MIB_FLOATS)
    for worker in ("w1", "w2"):
        assert _wait(
            lambda w=worker: (
                asyncrpc.rpc_sync(w, fns.echo, args=(big,)) is not None
                and asyncrpc.rpc_sync(w, fns.metrics)["shm_peers"] >= 1
                and asyncrpc.get_metrics()["shm_peers"] >= 2 - (w == "w1")
            )
        ), f"{worker} never shared memory with the driver"


@pytest.mark.parametrize("worker", ["w1", "w2"])
def test_shared_memory_echo_is_exact(group: Group, sharing: None, worker: str) -> None:
    """Dtypes, strides, aliasing and flags survive; the segments went through chunks."""
    base = torch.randn(600, 700, dtype=torch.float64)
    value = {
        "f32": torch.randn(MIB_FLOATS),
        "transposed": base.t(),  # strides kept: its span is the whole storage
        "int8": torch.randint(-128, 127, (3 << 20,), dtype=torch.int8),
        "bool": torch.rand(1 << 20) > 0.5,
        "small": torch.arange(10),  # inside the pickle, not a segment
        "param": torch.nn.Parameter(torch.randn(512, 512)),
    }
    value["again"] = value["f32"]
    sent_before = asyncrpc.get_metrics()["shm_segments_sent"]
    received_before = asyncrpc.get_metrics()["shm_segments_received"]
    remote_before = asyncrpc.rpc_sync(worker, fns.metrics)["shm_segments_received"]
    back = asyncrpc.rpc_sync(worker, fns.echo, args=(value,))
    after = asyncrpc.get_metrics()
    # f32 (once: "again" is the same tensor), transposed, int8, bool, param
    assert after["shm_segments_sent"] - sent_before == 5
    assert after["shm_segments_received"] - received_before == 5
    remote_after = asyncrpc.rpc_sync(worker, fns.metrics)["shm_segments_received"]
    assert remote_after - remote_before == 5
    for key, tensor in value.items():
        assert torch.equal(back[key], tensor), key
        assert back[key].dtype == tensor.dtype
    assert back["transposed"].stride() == base.t().stride()
    assert back["again"] is back["f32"]
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["param"].requires_grad
    remote = asyncrpc.rpc_sync(worker, fns.describe_tensor, args=(value["transposed"],))
    assert remote["stride"] == list(base.t().stride())


def test_shared_memory_results_held_stay_intact(group: Group, sharing: None) -> None:
    """Chunks are reused only once the receiver let go: eight held results never mix."""
    held = [asyncrpc.rpc_sync("w1", fns.filled, args=(MIB_FLOATS, float(i))) for i in range(8)]
    for _ in range(8):  # more traffic that could reuse a chunk still in use
        asyncrpc.rpc_sync("w1", fns.filled, args=(MIB_FLOATS, -1.0))
    assert [float(t.sum()) for t in held] == [float(i * MIB_FLOATS) for i in range(8)]
    held.clear()
    assert _wait(lambda: asyncrpc.rpc_sync("w1", fns.metrics)["shm_lent_bytes"] == 0), _shm(
        asyncrpc.rpc_sync("w1", fns.metrics)
    )


def test_shared_memory_receiver_may_write(group: Group, sharing: None) -> None:
    """A received tensor is writable, and writing to it changes nothing on the sender."""
    original = torch.ones(MIB_FLOATS)
    assert asyncrpc.rpc_sync("w1", fns.scale_in_place, args=(original, 3.0)) == 3.0 * MIB_FLOATS
    assert torch.equal(original, torch.ones(MIB_FLOATS))
    # The sender reuses that chunk for the next message: the receiver's write is gone.
    assert asyncrpc.rpc_sync("w1", fns.tensor_sum, args=(original,)) == float(MIB_FLOATS)


def test_shared_memory_chunks_come_back(group: Group, sharing: None) -> None:
    """Chunks lent to w1 for tensors it keeps return once it drops them."""
    for i in range(4):
        asyncrpc.rpc_sync("w1", fns.hold, args=(torch.full((MIB_FLOATS,), float(i)),))
    assert asyncrpc.get_metrics()["shm_lent_bytes"] >= 4 << 20
    assert asyncrpc.rpc_sync("w1", fns.held_sums) == [float(i * MIB_FLOATS) for i in range(4)]
    asyncrpc.rpc_sync("w1", fns.drop_held)
    assert _wait(lambda: asyncrpc.get_metrics()["shm_lent_bytes"] == 0), _shm(
        asyncrpc.get_metrics()
    )


# -- groups of their own ------------------------------------------------------------------


def _run(name: str, tmp_path: Path, *args: str, kill: bool = False) -> dict[str, Any]:
    """Run shm scenario ``name`` against a fresh w1; with ``kill``, SIGKILL w1 when told."""
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker("w1", 1, 2, init, log_dir=tmp_path, rpc_timeout=20.0,
                          shutdown_timeout=20.0)  # fmt: skip
    driver = scenarios.start(name, "--init-method", init, *args)
    try:
        if kill:
            driver.wait_line("HELD", 60)
            worker.kill()
            driver.send("KILLED")
        code, obs = driver.result(60)
        assert code == 0, driver.text()
        return obs
    finally:
        driver.kill()
        stop_workers([worker], timeout=10)


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_shared_memory_full_arena_falls_back_to_the_socket(tmp_path: Path) -> None:
    obs = _run("arena_full", tmp_path, "--arena-bytes", str(2 << 20))
    assert obs["shared"]
    assert obs["sums"] == [float(i * MIB_FLOATS) for i in range(8)]
    assert obs["while_held"]["shm_fallbacks"] >= 6  # 2 chunks of 1 MiB fit, not 8
    assert obs["while_held"]["shm_arena_bytes"] <= 2 << 20
    assert obs["returned"], obs["after"]


def test_shared_memory_off(tmp_path: Path) -> None:
    obs = _run("disabled", tmp_path, "--shared-memory", "0")
    assert obs["equal"]
    assert obs["driver"]["shm_segments_sent"] == obs["driver"]["shm_segments_received"] == 0
    assert obs["w1"]["shm_segments_sent"] == obs["w1"]["shm_peers"] == 0


def test_shared_memory_receiver_killed(tmp_path: Path) -> None:
    before = _dev_shm()
    obs = _run("kill_receiver", tmp_path, kill=True)
    assert obs["shared"]
    assert obs["stdin"] == "KILLED"
    assert obs["lost"]
    assert obs["lent_before"] >= 3 << 20
    assert obs["returned"], obs["after"]
    assert _dev_shm() <= before  # memfd chunks: never a name in /dev/shm


def test_shared_memory_sender_killed(tmp_path: Path) -> None:
    before = _dev_shm()
    obs = _run("kill_sender", tmp_path, kill=True)
    assert obs["shared"]
    assert obs["stdin"] == "KILLED"
    assert obs["lost"]
    assert obs["mapped_before"] >= 1
    # Received tensors outlive their sender: the mapping keeps the memory.
    assert obs["sums_after_kill"] == [float(i * MIB_FLOATS) for i in range(3)]
    assert obs["unmapped"]
    assert _dev_shm() <= before
