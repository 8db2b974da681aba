"""CUDA IPC on one GPU between real processes (skipped without CUDA): ``CudaDevices``
keeps the contract the fake simulates (a child process copies out of a block the parent
exported and filled, after the parent's queued kernel and before its later writes, with
no host sync at fill time), and the blocks of a consumer SIGKILLed while its copies were
pending are freed on the producer once its loss is detected."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import asyncrpc
from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests.gpu import cuda_fns as fns

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

SLEEP_CYCLES = 200_000_000
N = 1 << 22  # 16 MiB of float32


def _open_in_child(desc: tuple, nbytes: int, go: mp.Queue, results: mp.Queue) -> None:  # type: ignore[type-arg]
    from asyncrpc.runtime.cuda.real import CudaDevices

    gpu = CudaDevices()
    stream = gpu.new_stream(0)
    local, opened = gpu.open_block(desc)  # once: the producer fills it again
    for _ in range(2):
        go.get(timeout=120)
        flat, done = gpu.copy_from_block(opened, local, nbytes, 0, stream)
        with gpu.use_streams([stream]):
            total = float(flat.view(torch.float32).sum().item())
        results.put((total, gpu.done(done)))
    gpu.close_blocks([opened])


def test_CudaDevices_block_filled_then_copied_out_in_another_process_sees_the_queued_write() -> (
    None
):
    """Two messages through one block: each fill is queued behind a long kernel with no
    host sync, its message goes once the fill's event is done (what the send gate does),
    and the copy out in the other process sees that fill and not a write queued after."""
    from asyncrpc.runtime.cuda.real import CudaDevices

    gpu = CudaDevices()
    x = torch.zeros(N, device="cuda:0")
    block, desc = gpu.export_block(0, x.nbytes)
    ctx = mp.get_context("spawn")
    go, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(desc, x.nbytes, go, results))
    child.start()
    try:
        for value in (2.0, 3.0):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(value)
            started = time.perf_counter()
            filled = gpu.fill_block(block, x, x.nbytes, gpu.current_stream(0))
            assert time.perf_counter() - started < 0.05  # no host sync
            x.fill_(5.0)  # written after the fill: the consumer must not see it
            assert not gpu.done(filled)  # behind the kernel
            deadline = time.monotonic() + 60
            while not gpu.done(filled):  # the send gate's poll, bounded
                assert time.monotonic() < deadline
                time.sleep(0.001)
            go.put(True)
            assert results.get(timeout=120) == (value * N, True)
    finally:
        child.join(60)
    assert child.exitcode == 0


def test_killed_consumer_holding_shared_memory_does_not_leak_it(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(
        "gpu1", 1, 2, init, log_dir=tmp_path,
        extra_args=["--device-map", "driver=0:0", "--cuda-transfer", "ipc",
                    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
                    "--import", "tests.gpu.cuda_fns"],
    )  # fmt: skip
    options = asyncrpc.RpcBackendOptions(
        init_method=init, device_maps={"gpu1": {0: 0}}, cuda_transfer="ipc",
        heartbeat_interval=0.5, heartbeat_timeout=2.0,
    )  # fmt: skip
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)
    try:
        xs = [torch.ones(N, device="cuda:0") for _ in range(4)]
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(0)
        # Four blocks, exported to the consumer, opened there and named back.
        for fut in [asyncrpc.rpc_async("gpu1", fns.hold, args=(x,)) for x in xs]:
            fut.wait()
        asyncrpc.rpc_sync("gpu1", fns.memory_allocated)  # its reply names them back
        asyncrpc.rpc_sync("gpu1", fns.memory_allocated)
        # The consumer's copies out of them wait behind this kernel when it is killed.
        torch.cuda._sleep(20 * SLEEP_CYCLES)  # 2-4 s: longer than the kill takes
        for x in xs:
            asyncrpc.rpc_async("gpu1", fns.hold, args=(x,))
        time.sleep(0.3)
        os.kill(worker.pid, signal.SIGKILL)
        held = torch.cuda.memory_allocated(0)
        assert held >= baseline + 4 * N * 4  # the blocks: still allocated here
        deadline = time.monotonic() + 60
        while torch.cuda.memory_allocated(0) > baseline + N * 4:  # bounded by the deadline
            assert time.monotonic() < deadline, torch.cuda.memory_allocated(0)
            time.sleep(0.5)
    finally:
        try:
            asyncrpc.shutdown(graceful=False)
        finally:
            stop_workers([worker], timeout=0)
