"""The CUDA path above the device seam, on FakeDevices: which events a frame waits for,
when it may leave (in order, without blocking the loop), how a receiver's and a waiter's
streams are ordered after it, and the callee's bounded stream pool."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest

from asyncrpc.runtime.cuda import (
    FakeDevices,
    FakeTensor,
    FrameEvents,
    SendGate,
    StreamPool,
    StreamPoolExhaustedError,
    order_after,
    record_for,
)

pytestmark = pytest.mark.timeout(10)


async def _turns(n: int = 20) -> None:
    """Let the loop run a while (the gate polls with sleeps of 20 us and up)."""
    for _ in range(n):
        await asyncio.sleep(0.001)


# -- the fake itself -------------------------------------------------------------------------


def test_FakeDevices_event_completes_after_the_work_before_it() -> None:
    gpu = FakeDevices()
    stream = gpu.default_stream(0)
    gpu.launch(stream, "before")
    event = gpu.record(stream)
    gpu.launch(stream, "after")
    assert not gpu.done(event)
    assert gpu.run(stream, items=1) == 1
    assert gpu.done(event)


def test_FakeDevices_wait_orders_later_work_behind_the_event() -> None:
    gpu = FakeDevices()
    producer, consumer = gpu.new_stream(0), gpu.new_stream(1)
    gpu.launch(producer, "write x")
    gpu.wait(consumer, gpu.record(producer))
    read = gpu.launch(consumer, "read x")
    assert gpu.run(consumer) == 0  # blocked at the wait
    assert not read.done
    gpu.run(producer)
    assert gpu.run(consumer) == 2
    assert read.done


def test_FakeDevices_current_streams_are_per_thread() -> None:
    gpu = FakeDevices()
    mine = gpu.new_stream(0)
    seen: list[object] = []
    with gpu.use_streams([mine]):
        assert gpu.current_stream(0) is mine
        thread = threading.Thread(target=lambda: seen.append(gpu.current_stream(0)))
        thread.start()
        thread.join(5)
    assert seen == [gpu.default_stream(0)]
    assert gpu.current_stream(0) is gpu.default_stream(0)


# -- which events a frame waits for ----------------------------------------------------------


def test_record_for_records_one_event_per_device_on_the_current_streams() -> None:
    gpu = FakeDevices()
    side = gpu.new_stream(1)
    tensors = [FakeTensor(0), FakeTensor(0), FakeTensor(1), FakeTensor(None)]
    with gpu.use_streams([side]):
        frame = record_for(gpu, tensors)
    assert [device for device, _ in frame.events] == [0, 1]
    assert [event.stream for _, event in frame.events] == [gpu.default_stream(0), side]
    assert gpu.records == 2


def test_record_for_cpu_tensors_records_nothing() -> None:
    gpu = FakeDevices()
    assert not record_for(gpu, [FakeTensor(None), object()])
    assert gpu.records == 0


# -- when a frame may leave ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_SendGate_frame_without_gpu_work_passes_at_once() -> None:
    gate = SendGate(FakeDevices())
    await gate.ready(FrameEvents())
    assert gate.held == 0
    assert gate.polls == 0


@pytest.mark.asyncio
async def test_SendGate_frame_leaves_only_after_its_kernel_and_the_loop_runs_meanwhile() -> None:
    gpu = FakeDevices()
    stream = gpu.default_stream(0)
    gpu.launch(stream, "long kernel writing x")
    frame = record_for(gpu, [FakeTensor(0)])
    gate = SendGate(gpu)
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:  # cancelled below
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_work())
    leaving = asyncio.create_task(gate.ready(frame))
    await _turns()
    assert not leaving.done()
    assert ticks > 10  # the loop was never blocked by the wait
    gpu.run(stream)
    await asyncio.wait_for(leaving, 1)
    ticker.cancel()
    assert gate.held == 1
    assert gate.polls >= 1


@pytest.mark.asyncio
async def test_SendGate_waits_for_every_device_of_the_frame() -> None:
    gpu = FakeDevices()
    a, b = gpu.new_stream(0), gpu.new_stream(1)
    gpu.launch(a)
    gpu.launch(b)
    with gpu.use_streams([a, b]):
        frame = record_for(gpu, [FakeTensor(0), FakeTensor(1)])
    gate = SendGate(gpu)
    leaving = asyncio.create_task(gate.ready(frame))
    gpu.run(a)
    await _turns()
    assert not leaving.done()  # device 1's kernel still runs
    gpu.run(b)
    await asyncio.wait_for(leaving, 1)


class _Senders:
    """A gate with a slow first frame (a kernel still running on device 0) and frames
    queued behind it; ``left`` lists the frames in the order they left."""

    def __init__(self) -> None:
        self.gpu = FakeDevices()
        self.stream = self.gpu.default_stream(0)
        self.gpu.launch(self.stream)
        self.gate = SendGate(self.gpu)
        self.left: list[str] = []

    async def send(self, name: str, frame: FrameEvents) -> None:
        await self.gate.ready(frame)
        self.left.append(name)

    async def queue(self, *names: str) -> list[asyncio.Task[None]]:
        """The first waits for the kernel, the others for nothing but their turn."""
        slow = record_for(self.gpu, [FakeTensor(0)])
        tasks = []
        for index, name in enumerate(names):
            frame = slow if index == 0 else FrameEvents()
            tasks.append(asyncio.create_task(self.send(name, frame)))
            await asyncio.sleep(0)  # entered in this order
        return tasks


@pytest.mark.asyncio
async def test_SendGate_frames_leave_in_the_order_they_entered() -> None:
    senders = _Senders()
    tasks = await senders.queue("first", "second")
    await _turns()
    assert senders.left == []  # the second, with nothing to wait for, does not overtake
    senders.gpu.run(senders.stream)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert senders.left == ["first", "second"]


@pytest.mark.asyncio
async def test_SendGate_cancelled_frame_does_not_let_later_ones_overtake() -> None:
    senders = _Senders()
    first, second, third = await senders.queue("first", "second", "third")
    await _turns(3)
    second.cancel()
    await _turns()
    assert senders.left == []  # the third still waits for the first
    senders.gpu.run(senders.stream)
    await asyncio.wait_for(asyncio.gather(first, third), 1)
    assert senders.left == ["first", "third"]
    assert second.cancelled()
    assert senders.gate.idle()


# -- receivers and waiters ordered after a frame ---------------------------------------------


@pytest.mark.asyncio
async def test_callee_on_pool_streams_runs_after_the_frames_data() -> None:
    gpu = FakeDevices()
    sender = gpu.default_stream(0)
    gpu.launch(sender, "write x")
    frame = record_for(gpu, [FakeTensor(0)])
    pool = StreamPool(gpu, per_device=2)
    lease = await pool.acquire([0])
    order_after(gpu, list(lease.streams), frame)
    with gpu.use_streams(list(lease.streams)):
        callee_kernel = gpu.launch(gpu.current_stream(0), "read x")
    assert gpu.run(lease.streams[0]) == 0  # cannot read early
    gpu.run(sender)
    gpu.run(lease.streams[0])
    assert callee_kernel.done
    pool.release(lease)


def test_waiter_current_streams_wait_for_the_reply_then_chain_stays_ordered() -> None:
    """wait()/value()/then: the waiting thread's current stream waits on the reply's event;
    a callback's kernel queued after it is ordered behind the reply, without a host wait."""
    gpu = FakeDevices()
    callee = gpu.new_stream(0)
    gpu.launch(callee, "reply's kernel")
    with gpu.use_streams([callee]):
        reply = record_for(gpu, [FakeTensor(0)])
    waiter = gpu.default_stream(0)
    order_after(gpu, [gpu.current_stream(0)], reply)
    then_kernel = gpu.launch(gpu.current_stream(0), "then callback * 2")
    assert gpu.waits == 1
    gpu.run(waiter)
    assert not then_kernel.done
    gpu.run(callee)
    gpu.run(waiter)
    assert then_kernel.done


def test_order_after_leaves_streams_of_other_devices_alone() -> None:
    gpu = FakeDevices()
    frame = record_for(gpu, [FakeTensor(0)])
    order_after(gpu, [gpu.new_stream(1)], frame)
    assert gpu.waits == 0


# -- the callee's stream pool ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_StreamPool_makes_streams_lazily_up_to_its_bound_and_reuses_them() -> None:
    gpu = FakeDevices()
    pool = StreamPool(gpu, per_device=2)
    a, b = await pool.acquire([0]), await pool.acquire([0])
    assert a.streams[0] is not b.streams[0]
    assert gpu.streams_made == 2
    pool.release(a)
    pool.release(a)  # twice: no effect
    c = await pool.acquire([0])
    assert c.streams[0] is a.streams[0]
    assert gpu.streams_made == 2
    assert pool.in_use(0) == 2


@pytest.mark.asyncio
async def test_StreamPool_exhausted_waits_in_order_then_hands_over() -> None:
    gpu = FakeDevices()
    pool = StreamPool(gpu, per_device=1, timeout=5)
    held = await pool.acquire([0])
    first = asyncio.create_task(pool.acquire([0]))
    await asyncio.sleep(0)
    second = asyncio.create_task(pool.acquire([0]))
    await _turns(3)
    assert not first.done()
    pool.release(held)
    got = await asyncio.wait_for(first, 1)
    assert got.streams == held.streams
    assert not second.done()
    pool.release(got)
    await asyncio.wait_for(second, 1)


@pytest.mark.asyncio
async def test_StreamPool_exhausted_past_its_timeout_raises_typed_and_keeps_nothing() -> None:
    gpu = FakeDevices()
    pool = StreamPool(gpu, per_device=1, timeout=0.05)
    held = await pool.acquire([1])
    with pytest.raises(StreamPoolExhaustedError) as info:
        await pool.acquire([0, 1])  # device 0 is taken first, then given back
    assert isinstance(info.value, TimeoutError)
    assert info.value.device == 1
    assert pool.in_use(0) == 0
    restored = pickle.loads(pickle.dumps(info.value))
    assert type(restored) is StreamPoolExhaustedError
    assert str(restored) == str(info.value)
    pool.release(held)
    lease = await pool.acquire([0, 1])
    assert lease.devices == (0, 1)


@pytest.mark.asyncio
async def test_StreamPool_cancelled_waiter_gives_its_place_up() -> None:
    gpu = FakeDevices()
    pool = StreamPool(gpu, per_device=1, timeout=5)
    held = await pool.acquire([0])
    cancelled = asyncio.create_task(pool.acquire([0]))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(pool.acquire([0]))
    await _turns(3)
    cancelled.cancel()
    await asyncio.sleep(0)
    pool.release(held)
    got = await asyncio.wait_for(waiting, 1)
    assert got.streams == held.streams


@pytest.mark.asyncio
async def test_StreamPool_release_from_another_thread_hands_over_through_the_loop() -> None:
    gpu = FakeDevices()
    pool = StreamPool(gpu, per_device=1, timeout=5)
    held = pool.try_acquire([0])
    assert held is not None
    assert pool.try_acquire([0]) is None  # never waits
    waiting = asyncio.create_task(pool.acquire([0]))
    await asyncio.sleep(0)
    thread = threading.Thread(target=pool.release, args=(held,))
    thread.start()
    thread.join(5)
    got = await asyncio.wait_for(waiting, 1)
    assert got.streams == held.streams
    assert (pool.leased, pool.released) == (2, 1)
