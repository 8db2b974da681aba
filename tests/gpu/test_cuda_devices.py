"""CudaDevices keeps the contract FakeDevices simulates, on real hardware (skipped without
CUDA): events complete after the work before them, a wait orders a stream behind an event
without the host waiting, the gate lets a frame leave only after a long kernel while the
loop runs on, and a callee's pool stream reads the data only after it is written."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1-0.2 s on current GPUs


def _devices():  # imported lazily: the module needs torch.cuda
    from asyncrpc.runtime.cuda.real import CudaDevices

    return CudaDevices()


def test_CudaDevices_event_and_wait_order_work_without_a_host_sync() -> None:
    gpu = _devices()
    producer, consumer = gpu.new_stream(0), gpu.new_stream(0)
    x = torch.zeros(1 << 20, device="cuda:0")
    # Load the kernels first: CUDA loads a module lazily at its first launch, and that
    # load waited for the running kernel (100 ms on an H100), which is no stream wait.
    for stream in (producer, consumer):
        with gpu.use_streams([stream]):
            x.fill_(0.0)
            (x * 2).sum()
    torch.cuda.synchronize()
    with gpu.use_streams([producer]):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(7.0)
        event = gpu.record(gpu.current_stream(0))
    assert not gpu.done(event)  # the kernel still runs: nothing waited for it
    started = time.perf_counter()
    gpu.wait(consumer, event)
    with gpu.use_streams([consumer]):
        y = x * 2
    assert time.perf_counter() - started < 0.05  # queuing the wait did not block the host
    torch.cuda.synchronize()
    assert gpu.done(event)
    assert torch.all(y == 14.0)


def test_CudaDevices_chunked_copy_out_into_a_pooled_pinned_block() -> None:
    from asyncrpc.runtime.cuda.pinned import PinnedPool

    gpu = _devices()
    pool = PinnedPool(gpu)
    stream = gpu.new_stream(0)
    x = torch.arange(5 << 20, device="cuda:0", dtype=torch.float32)  # 20 MiB
    nbytes = gpu.contiguous_nbytes(x)
    assert nbytes == x.numel() * 4
    assert gpu.contiguous_nbytes(x.view(-1, 4).t()) is None
    flat, block = pool.lend(nbytes)
    assert block is not None
    assert flat.is_pinned()
    gpu.wait(stream, gpu.record(gpu.current_stream(0)))
    events = []
    for start in range(0, nbytes, 8 << 20):
        gpu.copy_out(x, flat, start, min(start + (8 << 20), nbytes), stream)
        events.append(gpu.record(stream))
    host = gpu.host_view(flat, x)
    torch.cuda.synchronize()
    assert all(gpu.done(event) for event in events)
    assert host.shape == x.shape
    assert torch.equal(host, x.cpu())


@pytest.mark.asyncio
async def test_SendGate_on_cuda_frame_leaves_after_the_kernel_loop_runs_on() -> None:
    from asyncrpc.runtime.cuda import SendGate, record_for

    gpu = _devices()
    x = torch.zeros(16, device="cuda:0")
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(3.0)
    started = time.perf_counter()
    frame = record_for(gpu, [x])
    assert time.perf_counter() - started < 0.05
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_work())
    await asyncio.wait_for(SendGate(gpu).ready(frame), 10)
    ticker.cancel()
    assert ticks > 10
    assert torch.all(x.cpu() == 3.0)


def test_CudaDevices_identity_names_every_visible_gpu_by_uuid() -> None:
    identity = _devices().identity()
    assert len(identity.uuids) == torch.cuda.device_count()
    assert len(set(identity.uuids)) == len(identity.uuids)
    assert identity.index_of(identity.uuids[0]) == 0
