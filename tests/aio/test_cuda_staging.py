"""The staged CUDA transfer and the device-map hook above the device seam, on FakeDevices:
which events a message's frame waits for, that neither the sender nor the loop waits for
the GPU, how received tensors' users are ordered after their copies (callee function,
caller's Future), and device-map errors."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.runtime.calls.pipeline import CallKind, IncomingCall, OutgoingCall, Pipeline
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.maps import FIELD, DeviceMapHook, HostCopy, HostTransfer
from asyncrpc.runtime.cuda.staging import StagedCopy, StagedTransfer
from asyncrpc.runtime.futures import Future
from tests.fakes import pending_call, settled

pytestmark = pytest.mark.timeout(10)

MAP = {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}


def staged(gpu: FakeDevices) -> StagedTransfer:
    return StagedTransfer(gpu)


# -- sending ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_frame_waits_for_the_producer_then_for_the_copy_never_blocking() -> None:
    gpu = FakeDevices()
    transfer = staged(gpu)
    producer = gpu.launch(gpu.default_stream(0), "writes x")
    policy = transfer.policy(MAP)
    target, host = policy.to_host(FakeTensor(0, "x"))
    assert target == "cuda:1"
    assert host.fake_device is None
    assert host.value == "x"
    out = transfer.out_stream(0)
    assert [item.label for item in out.items] == [
        "wait for default0",
        "copy to host on " + out.name,
    ]
    ready = transfer.ready(policy)
    assert ready is not None
    gate = asyncio.ensure_future(ready)
    assert not await settled(asyncio.shield(gate))  # the producer kernel is still queued
    gpu.run(out)
    assert not producer.done
    assert not out.items[-1].done
    gpu.run(gpu.default_stream(0))
    gpu.run(out)
    assert await settled(gate)
    assert transfer.gate.held == 1
    assert transfer.staged_out == 1


@pytest.mark.asyncio
async def test_one_producer_event_per_device_and_the_last_copy_covers_the_rest() -> None:
    gpu = FakeDevices()
    transfer = staged(gpu)
    policy = transfer.policy(MAP)
    for tensor in (FakeTensor(0, "a"), FakeTensor(1, "b"), FakeTensor(0, "c")):
        policy.to_host(tensor)
    # Producer events: one per device (2); copy events: one per tensor, last one kept.
    assert gpu.records == 2 + 3
    assert sorted(policy.events) == [0, 1]
    assert policy.events[0].upto == len(transfer.out_stream(0).items)
    ready = transfer.ready(policy)
    assert ready is not None
    gpu.run(transfer.out_stream(0))
    gpu.run(transfer.out_stream(1))
    assert await settled(ready)
    assert transfer.ready(policy) is None  # copies done before it is asked: no hold


@pytest.mark.asyncio
async def test_nothing_staged_means_nothing_to_wait_for() -> None:
    transfer = staged(FakeDevices())
    assert transfer.ready(transfer.policy(MAP)) is None
    assert transfer.before_use(transfer.policy({})) is None
    assert transfer.ready(HostCopy(MAP)) is None


def test_a_device_the_map_does_not_name_is_refused_with_its_name() -> None:
    gpu = FakeDevices()
    policy = staged(gpu).policy({"cuda:0": "cuda:0"})
    with pytest.raises(SerializationError, match=r"'cuda:1'.*device map has no entry"):
        policy.to_host(FakeTensor(1, "x"))
    assert gpu.copies == 0


# -- receiving -------------------------------------------------------------------------------


def test_received_tensors_first_user_waits_for_their_copies_on_its_own_streams() -> None:
    gpu = FakeDevices()
    transfer = staged(gpu)
    policy = transfer.policy({})
    tensor = policy.to_device(b"bytes", "cuda:1")
    assert tensor.fake_device == 1
    assert tensor.value == b"bytes"
    first = transfer.before_use(policy)
    assert first is not None
    mine = gpu.new_stream(1)
    with gpu.use_streams([mine]):
        first()
        kernel = gpu.launch(mine, "reads tensor")
    assert gpu.run(mine) == 0  # the wait comes first and its copy has not run
    assert gpu.kept == [(tensor, mine)]  # its memory is not reused before `mine` read it
    gpu.run(transfer.in_stream(1))
    gpu.run(mine)
    assert kernel.done
    assert gpu.default_stream(1).items == []  # other threads' streams are left alone


def test_a_cpu_tag_is_left_to_the_default() -> None:
    policy = staged(FakeDevices()).policy({})
    segment = torch.zeros(4, dtype=torch.uint8)
    assert policy.to_device(segment, "cpu").device.type == "cpu"
    assert policy.events == {}


# -- the hook --------------------------------------------------------------------------------


def outgoing(callee: str = "w1") -> OutgoingCall:
    return OutgoingCall(CallKind.ASYNC, "w0", callee, 1, print, "builtins.print", (), {})


@pytest.mark.asyncio
async def test_hook_gives_mapped_calls_their_policies_and_holds_their_frames() -> None:
    gpu = FakeDevices()
    hook = DeviceMapHook({"w1": {"cuda:0": "cuda:1"}}, staged(gpu))
    pipeline = Pipeline([hook])
    call = outgoing()
    hooks = pipeline.active_hooks()
    Pipeline.prepare(hooks, call)
    assert call.headers[FIELD] == {"cuda:1": "cuda:0"}  # the reply's map
    assert isinstance(call.policy.devices, StagedCopy)
    call.policy.to_host(FakeTensor(0, "x"))  # what pickling does
    ready = Pipeline.ready(hooks, call)
    assert ready is not None
    assert not await settled(asyncio.shield(ready := asyncio.ensure_future(ready)))
    gpu.run(staged_out := hook.transfer.out_stream(0))  # type: ignore[attr-defined]
    assert staged_out.pending() == []
    assert await settled(ready)
    other = outgoing("w2")
    Pipeline.prepare(hooks, other)
    assert FIELD not in other.headers
    assert Pipeline.ready(hooks, other) is None


def test_hook_without_maps_is_inactive() -> None:
    assert Pipeline([DeviceMapHook(None)]).active_hooks() == ()
    assert Pipeline([DeviceMapHook({"w1": {}})]).active_hooks() == ()


def test_hook_on_the_callee_orders_the_function_after_the_copies_on_its_thread() -> None:
    gpu = FakeDevices()
    hook = DeviceMapHook(None, staged(gpu))
    pipeline = Pipeline([hook])
    served = IncomingCall("w0", 0, "w1", 7, "m.f", False, {FIELD: {"cuda:1": "cuda:0"}})
    pipeline.receiving(served)
    arg = served.policy.to_device(b"x", "cuda:1")  # what unpickling does
    pipeline.incoming(served)
    ran: list[Any] = []
    fn = served.wrapped(lambda t: ran.append([item.label for item in gpu.current_stream(1).items]))
    thread = threading.Thread(target=fn, args=(arg,))
    thread.start()
    thread.join(5)
    assert ran == [["wait for " + hook.transfer.in_stream(1).name]]  # type: ignore[attr-defined]
    assert isinstance(served.reply_policy.devices, StagedCopy)
    assert served.reply_policy.devices.device_map == {"cuda:1": "cuda:0"}


@pytest.mark.asyncio
async def test_hook_on_the_callee_wraps_async_functions_as_coroutines() -> None:
    gpu = FakeDevices()
    pipeline = Pipeline([DeviceMapHook(None, staged(gpu))])
    served = IncomingCall("w0", 0, "w1", 7, "m.f", False, {FIELD: {}})
    pipeline.receiving(served)
    served.policy.to_device(b"x", "cuda:0")
    served.coroutine = True
    pipeline.incoming(served)

    async def double(x: int) -> int:
        return 2 * x

    assert await served.wrapped(double)(21) == 42
    assert gpu.default_stream(0).items[0].label.startswith("wait for")


def test_hook_refuses_a_malformed_reply_map() -> None:
    pipeline = Pipeline([DeviceMapHook(None, HostTransfer())])
    served = IncomingCall("w0", 0, "w1", 7, "m.f", False, {FIELD: {"cuda:0": 3}})
    with pytest.raises(SerializationError, match="malformed device map"):
        pipeline.receiving(served)


# -- the caller's future ---------------------------------------------------------------------


def test_reply_readers_wait_for_its_copies_through_the_future() -> None:
    gpu = FakeDevices()
    hook = DeviceMapHook({"w1": {"cuda:0": "cuda:0"}}, staged(gpu))
    call = outgoing()
    hooks = Pipeline([hook]).active_hooks()
    Pipeline.prepare(hooks, call)
    value = call.reply_policy.to_device(b"reply", "cuda:0")  # what unpickling the reply does
    future: Future[Any] = Future()
    pending = pending_call(future, 1, "m.f", 0.0, observed=(hooks, call))
    pending.resolve(value, {})
    assert call.on_value is not None
    assert gpu.default_stream(0).items == []  # nothing waits before somebody reads it
    seen: list[Any] = []
    chained = future.then(lambda f: seen.append(f.value()))
    chained.wait(5)
    assert future.wait() is value
    waits = [item for item in gpu.default_stream(0).items if item.after is not None]
    assert len(waits) == 2  # the callback's read and this thread's
    assert seen == [value]


def test_segments_bound_for_a_gpu_land_in_host_buffers_of_the_seam() -> None:
    gpu = FakeDevices()
    owner, view = staged(gpu).allocate(100)
    assert gpu.host_buffers == 1
    assert view.nbytes == 100
    view[:3] = b"abc"
    assert bytes(owner[:3].tolist()) == b"abc"  # the view writes the owner's memory


# -- a remote() value kept by its owner --------------------------------------------------------


def test_a_remembered_value_is_sent_only_after_the_work_that_made_it() -> None:
    # remote(): the value was made on the request's pool stream and is sent later (to_here)
    # from another thread's stream; without the remembered event the copy would read it
    # before that work ran (seen on an H100: a to_here returned the memory's old bytes).
    gpu = FakeDevices()
    transfer = staged(gpu)
    pool_stream = gpu.new_stream(0)
    made = gpu.launch(pool_stream, "computes y")
    y = FakeTensor(0, "y")
    transfer.remember([y, "not a tensor"], [pool_stream])
    policy = transfer.policy(MAP)
    policy.to_host(y)  # on this thread: its default stream is current
    out = transfer.out_stream(0)
    gpu.run(gpu.default_stream(0))
    gpu.run(out)
    assert not out.items[-1].done  # the copy waits for the pool stream's work
    gpu.run(pool_stream)
    assert made.done
    gpu.run(gpu.default_stream(0))
    gpu.run(out)
    assert out.items[-1].done


def test_a_value_not_remembered_or_gone_adds_no_wait() -> None:
    gpu = FakeDevices()
    transfer = staged(gpu)
    pool_stream = gpu.new_stream(0)
    gpu.launch(pool_stream, "computes y")
    y = FakeTensor(0, "y")
    transfer.remember(y, [pool_stream])
    del y
    assert transfer._made == {}  # forgotten with the tensor
    waits = gpu.waits
    transfer.policy(MAP).to_host(FakeTensor(0, "z"))
    assert gpu.waits == waits + 1  # only the copy stream's wait for the producer
