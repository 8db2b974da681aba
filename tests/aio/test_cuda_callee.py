"""The callee runs on leased pool streams (torch's rule 2), on FakeDevices: the function
sees them current (on a pool thread, and per step for ``async def`` on the loop), they
waited for the request's data first, concurrent requests get different ones, the reply's
events are recorded on them, and the lease goes back after the reply left, on error, on
cancellation and when a request is dropped; an exhausted pool is a typed error for the
caller. Through the pipeline's hooks, and through the real dispatcher."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest
import torch

from asyncrpc.protocol.serde import Serializer, unpack_exception
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.wire import Frame, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import CallMode, Kind, Request, decode_message
from asyncrpc.runtime.calls.dispatch import Dispatcher
from asyncrpc.runtime.calls.pipeline import CallKind, IncomingCall, OutgoingCall, Pipeline
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor, StreamPool, StreamPoolExhaustedError
from asyncrpc.runtime.cuda.callee import CalleeStreams, on_streams
from asyncrpc.runtime.cuda.fake import FakeStream
from asyncrpc.runtime.cuda.maps import FIELD, DeviceMapHook
from asyncrpc.runtime.cuda.staging import StagedTransfer
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.metrics import Counters
from asyncrpc.runtime.ports import Loop
from asyncrpc.runtime.threads.pool import WorkerPool
from tests.fakes import NoProducers, NoRRefs, pending_call

pytestmark = pytest.mark.timeout(10)

BACK = {"cuda:0": "cuda:0"}  # the reply's map a caller sends


class Gpu(FakeDevices):
    """FakeDevices whose copies to a device give back a real CPU tensor (so the serializer
    can rebuild it), still queued as simulated work on the copy stream."""

    def stage_in(self, segment: Any, device: int, stream: FakeStream) -> Any:
        super().stage_in(segment, device, stream)
        return segment.clone()


def setup(per_device: int = 4, timeout: float = 5.0) -> tuple[Gpu, StagedTransfer, Pipeline]:
    gpu = Gpu()
    callee = CalleeStreams(gpu, StreamPool(gpu, per_device, timeout))
    transfer = StagedTransfer(gpu, callee=callee)
    return gpu, transfer, Pipeline([DeviceMapHook(None, transfer)])


def served(pipeline: Pipeline, *, remote: bool = False, coroutine: bool = False) -> IncomingCall:
    call = IncomingCall("w0", 0, "w1", 7, "m.f", remote, {FIELD: dict(BACK)})
    pipeline.receiving(call)
    call.policy.to_device(torch.zeros(4, dtype=torch.uint8), "cuda:0")  # what unpickling does
    call.coroutine = coroutine
    pipeline.incoming(call)
    return call


def pool_of(transfer: StagedTransfer) -> StreamPool:
    assert transfer.callee is not None
    return transfer.callee.pool


def labels(stream: FakeStream) -> list[str]:
    return [item.label for item in stream.items]


# -- running on the pool's streams -----------------------------------------------------------


def test_sync_function_runs_on_a_pool_stream_that_waited_for_the_request_data() -> None:
    gpu, transfer, pipeline = setup()
    call = served(pipeline)
    seen: list[FakeStream] = []

    def fn() -> None:
        stream = gpu.current_stream(0)
        seen.append(stream)
        gpu.launch(stream, "reads the argument")

    thread = threading.Thread(target=call.wrapped(fn))
    thread.start()
    thread.join(5)
    (stream,) = seen
    assert stream is not gpu.default_stream(0)
    lease = call.state[pipeline.hooks[0]].lease
    assert lease is not None
    assert lease.streams == (stream,)
    copy_in = transfer.in_stream(0)
    assert labels(stream) == ["wait for " + copy_in.name, "reads the argument"]
    assert [kept for _, kept in gpu.kept] == [stream]  # the argument's memory, for its reader
    assert gpu.run(stream) == 0  # the copy of the argument has not run: nothing may read
    gpu.run(copy_in)
    assert gpu.run(stream) == 2
    assert gpu.default_stream(0).items == []  # the thread's own stream was left alone
    assert gpu.current_stream(0) is gpu.default_stream(0)


@pytest.mark.asyncio
async def test_async_function_has_its_pool_streams_current_in_its_steps_only() -> None:
    gpu, _, pipeline = setup()
    call = served(pipeline, coroutine=True)
    inside: list[FakeStream] = []
    between: list[FakeStream] = []
    proceed = asyncio.Event()

    async def fn() -> int:
        inside.append(gpu.current_stream(0))
        await proceed.wait()
        inside.append(gpu.current_stream(0))
        return 5

    async def other_task() -> None:
        between.append(gpu.current_stream(0))  # runs while fn is suspended
        proceed.set()

    task = asyncio.ensure_future(call.wrapped(fn)())
    await asyncio.sleep(0)
    await other_task()
    assert await task == 5
    assert inside[0] is inside[1] is not gpu.default_stream(0)
    assert between == [gpu.default_stream(0)]
    assert gpu.current_stream(0) is gpu.default_stream(0)


@pytest.mark.asyncio
async def test_on_streams_passes_exceptions_and_cancellation_into_the_coroutine() -> None:
    gpu = FakeDevices()
    stream = gpu.new_stream(0)
    seen: list[Any] = []

    async def fn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(gpu.current_stream(0))
            raise

    task = asyncio.ensure_future(on_streams(gpu, [stream], fn()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [stream]  # its handler ran on its streams too
    assert gpu.current_stream(0) is gpu.default_stream(0)


@pytest.mark.asyncio
async def test_two_concurrent_requests_get_different_streams() -> None:
    gpu, transfer, pipeline = setup()
    first, second = served(pipeline, coroutine=True), served(pipeline, coroutine=True)
    seen: list[FakeStream] = []
    both = asyncio.Event()

    async def fn() -> None:
        seen.append(gpu.current_stream(0))
        if len(seen) == 2:
            both.set()
        await both.wait()

    await asyncio.gather(first.wrapped(fn)(), second.wrapped(fn)())
    assert seen[0] is not seen[1]
    assert pool_of(transfer).in_use(0) == 2  # held until their replies left
    for call in (first, second):
        pipeline.replying(call, True, None)
        assert pipeline.reply_ready(call) is None
    assert pool_of(transfer).in_use(0) == 0


def test_a_caller_map_naming_devices_this_worker_lacks_leases_none_of_them() -> None:
    _, transfer, pipeline = setup()
    call = IncomingCall("w0", 0, "w1", 7, "m.f", False, {FIELD: {"cuda:7": "cuda:0"}})
    pipeline.receiving(call)
    pipeline.incoming(call)
    assert call.wrappers == []  # runs as before; a tensor for cuda:7 fails, naming it
    assert pool_of(transfer).leased == 0


# -- the reply -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_reply_waits_for_the_function_kernel_on_its_pool_stream_then_gives_it_back() -> None:
    gpu, transfer, pipeline = setup()
    call = served(pipeline, coroutine=True)
    kernels: list[Any] = []

    async def fn() -> FakeTensor:
        kernels.append(gpu.launch(gpu.current_stream(0), "writes the result"))
        return FakeTensor(0, "y")

    result = await call.wrapped(fn)()
    # Pickling the reply on the loop (not on the pool stream) records on the pool stream.
    assert gpu.current_stream(0) is gpu.default_stream(0)
    call.reply_policy.to_host(result)
    pipeline.replying(call, True, result)
    ready = pipeline.reply_ready(call)
    assert ready is not None
    leaving = asyncio.ensure_future(ready)
    await asyncio.sleep(0.01)
    assert not leaving.done()
    (stream,) = call.state[pipeline.hooks[0]].lease.streams
    assert pool_of(transfer).in_use(0) == 1  # not back before the frame left
    gpu.run(transfer.in_stream(0))
    gpu.run(stream)  # the argument's copy, then the function's kernel
    assert kernels[0].done
    gpu.run(transfer.out_stream(0))
    await asyncio.wait_for(leaving, 5)
    assert pool_of(transfer).in_use(0) == 0


def test_reply_with_no_pool_is_pickled_on_the_current_stream_as_before() -> None:
    gpu = FakeDevices()
    transfer = StagedTransfer(gpu)
    policy = transfer.policy(BACK)
    policy.to_host(FakeTensor(0, "y"))
    assert labels(transfer.out_stream(0))[0] == "wait for default0"


# -- the lease goes back ---------------------------------------------------------------------


def test_lease_goes_back_when_the_function_raises() -> None:
    _, transfer, pipeline = setup()
    call = served(pipeline)

    def fn() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        call.wrapped(fn)()
    assert pool_of(transfer).in_use(0) == 0
    pipeline.replying(call, False, KeyError("boom"))  # the error reply: no second release
    assert pool_of(transfer).released == 1


@pytest.mark.asyncio
async def test_lease_goes_back_when_the_request_is_cancelled() -> None:
    _, transfer, pipeline = setup()
    call = served(pipeline, coroutine=True)
    task = asyncio.ensure_future(call.wrapped(asyncio.sleep)(30))
    await asyncio.sleep(0.01)
    assert pool_of(transfer).in_use(0) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool_of(transfer).in_use(0) == 0


def test_lease_of_a_remote_value_goes_back_once_it_is_kept() -> None:
    _, transfer, pipeline = setup()
    call = served(pipeline, remote=True)
    assert call.wrapped(lambda: 3)() == 3
    assert pool_of(transfer).in_use(0) == 1
    pipeline.replying(call, True, 3)
    assert pool_of(transfer).in_use(0) == 0


@pytest.mark.parametrize("coroutine", [False, True])
def test_a_remote_value_is_remembered_with_the_streams_it_was_made_on(coroutine: bool) -> None:
    # Before the owner keeps it: a to_here that came first may send it at once, from
    # another stream (seen on an H100: the value's memory read before its kernel ran).
    gpu, transfer, pipeline = setup()
    remembered: list[tuple[Any, list[Any]]] = []
    transfer.remember = lambda value, streams: remembered.append((value, streams))  # type: ignore[method-assign]
    y = FakeTensor(0, "y")
    for remote in (False, True):
        call = served(pipeline, remote=remote, coroutine=coroutine)
        if coroutine:

            async def make() -> FakeTensor:
                return y

            assert asyncio.run(call.wrapped(make)()) is y
        else:
            assert call.wrapped(lambda: y)() is y
        assert len(remembered) == int(remote)  # as it returns, before the owner keeps it
        pipeline.replying(call, True, y)
    ((value, streams),) = remembered  # the remote() call only
    assert value is y
    assert len(streams) == 1
    assert streams[0] is not gpu.default_stream(0)  # its leased pool stream


def test_lease_of_a_stream_producer_goes_back_once_its_generator_is_made() -> None:
    _, transfer, pipeline = setup()
    call = served(pipeline)

    def items() -> Any:
        yield 1

    assert list(call.wrapped(items)()) == [1]
    assert pool_of(transfer).in_use(0) == 0


def test_lease_of_a_request_dropped_unannounced_goes_back_when_it_is_collected() -> None:
    _, transfer, pipeline = setup()
    call = served(pipeline)
    call.wrapped(lambda: None)()
    assert pool_of(transfer).in_use(0) == 1
    del call  # cancelled after its function returned: the hooks are not told
    gc.collect()
    assert pool_of(transfer).in_use(0) == 0


@pytest.mark.asyncio
async def test_sync_function_waits_on_its_thread_for_a_stream_given_back() -> None:
    gpu, transfer, pipeline = setup(per_device=1)
    holder, waiter = served(pipeline), served(pipeline)
    holder.wrapped(lambda: None)()
    seen: list[FakeStream] = []
    run = asyncio.get_running_loop().run_in_executor(
        None, waiter.wrapped(lambda: seen.append(gpu.current_stream(0)))
    )
    await asyncio.sleep(0.05)
    assert seen == []  # waiting its turn, on its own thread
    pipeline.replying(holder, False, None)
    await asyncio.wait_for(run, 5)
    assert len(seen) == 1
    assert pool_of(transfer).in_use(0) == 1


# -- through the dispatcher ------------------------------------------------------------------


class TagCuda(TensorPolicy):
    """A sender's policy that tags CPU tensors "cuda:0" (no CUDA needed to make the frame)."""

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return "cuda:0", tensor.cpu()


def _frames(pieces: list[Any]) -> list[Frame]:
    return FrameDecoder().feed(b"".join(bytes(p) for p in pieces))


def _request(call_id: int, fn: Any, args: tuple[Any, ...], mode: int = CallMode.CALL) -> Any:
    payload, segments, _, _ = Serializer().dumps((fn, args, {}), policy=TagCuda())
    fields = Request(call_id, 0, mode, "fn", None, None, {FIELD: dict(BACK)}).to_fields()
    (frame,) = _frames(encode_frame(fields, payload, segments))
    request = decode_message(frame.fields)
    return request, frame.payload, frame.segments


class Caller:
    def __init__(self) -> None:
        self.peer: int | None = 1
        self.peer_name: str | None = "w1"


GPU = Gpu()
SEEN: list[Any] = []


def on_pool_thread(x: torch.Tensor) -> int:
    SEEN.append(GPU.current_stream(0))
    return int(x.numel())


async def on_loop(x: torch.Tensor) -> int:
    SEEN.append(GPU.current_stream(0))
    await asyncio.sleep(0.2)
    return int(x.numel())


async def _dispatcher(per_device: int, timeout: float) -> tuple[Dispatcher, Any, Any, Any]:
    loop = asyncio.get_running_loop()
    written: list[Frame] = []
    pool = StreamPool(GPU, per_device, timeout)
    transfer = StagedTransfer(GPU, callee=CalleeStreams(GPU, pool))
    workers = WorkerPool(2, loop, "me")

    def write(conn: Any, pieces: list[Any], keep: object, forks: Any) -> None:
        written.extend(_frames(pieces))

    dispatcher = Dispatcher(
        "me", Loop(loop, workers), Serializer(), write, Counters(),
        Pipeline([DeviceMapHook(None, transfer)]), NoRRefs(), NoProducers(), print_errors=False,
    )  # fmt: skip
    return dispatcher, written, pool, workers


async def _until(check: Any) -> None:
    for _ in range(500):  # bounded: 5 s
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


@pytest.mark.asyncio
async def test_Dispatcher_runs_a_request_on_a_pool_stream_and_gives_it_back_after_the_reply() -> (
    None
):
    SEEN.clear()
    dispatcher, written, pool, workers = await _dispatcher(2, 5.0)
    dispatcher.on_request(Caller(), *_request(3, on_pool_thread, (torch.ones(3),)))
    await _until(lambda: written)
    (frame,) = written
    assert frame.fields[:2] == [Kind.REPLY, 3]
    assert Serializer().loads(frame.payload, frame.segments) == 3
    assert SEEN[0] is not GPU.default_stream(0)
    assert pool.in_use(0) == 0
    assert pool.leased == pool.released == 1
    workers.shutdown()


@pytest.mark.asyncio
async def test_Dispatcher_exhausted_pool_fails_the_request_with_a_typed_error() -> None:
    SEEN.clear()
    dispatcher, written, pool, workers = await _dispatcher(1, 0.05)
    dispatcher.on_request(Caller(), *_request(1, on_loop, (torch.ones(2),)))
    await _until(lambda: SEEN)
    dispatcher.on_request(Caller(), *_request(2, on_pool_thread, (torch.ones(2),)))
    await _until(lambda: len(written) == 2)
    error = next(f for f in written if f.fields[1] == 2)
    assert error.fields[0] == Kind.ERROR
    exc = unpack_exception(error.payload)
    assert isinstance(exc, StreamPoolExhaustedError)
    assert exc.device == 0
    reply = next(f for f in written if f.fields[1] == 1)
    assert reply.fields[0] == Kind.REPLY
    assert pool.in_use(0) == 0
    workers.shutdown()


@pytest.mark.asyncio
async def test_Dispatcher_cancelled_request_gives_its_stream_back() -> None:
    SEEN.clear()
    dispatcher, written, pool, workers = await _dispatcher(1, 5.0)
    dispatcher.on_request(Caller(), *_request(4, on_loop, (torch.ones(2),)))
    await _until(lambda: SEEN)
    assert pool.in_use(0) == 1
    dispatcher.on_cancel(1, 4)
    await _until(lambda: pool.in_use(0) == 0)
    assert written == []
    workers.shutdown()


@pytest.mark.asyncio
async def test_then_chain_on_the_caller_is_ordered_after_the_callee_kernel_and_the_copies() -> None:
    gpu, transfer, pipeline = setup()  # the callee's process
    call = served(pipeline)
    kernel: list[Any] = []

    def fn() -> FakeTensor:
        kernel.append(gpu.launch(gpu.current_stream(0), "writes the reply"))
        return FakeTensor(0, "y")

    result = call.wrapped(fn)()
    call.reply_policy.to_host(result)  # pickled off the pool stream, on the pool thread
    pipeline.replying(call, True, result)
    ready = pipeline.reply_ready(call)
    assert ready is not None
    leaving = asyncio.ensure_future(ready)
    gpu.run(transfer.out_stream(0))
    await asyncio.sleep(0.01)
    assert not leaving.done()  # the copy waits for the callee's kernel on its pool stream
    gpu.run(transfer.in_stream(0))
    gpu.run(call.state[pipeline.hooks[0]].lease.streams[0])
    gpu.run(transfer.out_stream(0))
    await asyncio.wait_for(leaving, 5)
    assert kernel[0].done

    caller_gpu = FakeDevices()  # the caller's process: the frame's bytes arrived
    caller = StagedTransfer(caller_gpu)
    hook = DeviceMapHook({"w1": {"cuda:0": "cuda:0"}}, caller)
    out = OutgoingCall(CallKind.ASYNC, "w0", "w1", 1, print, "builtins.print", (), {})
    hooks = Pipeline([hook]).active_hooks()
    Pipeline.prepare(hooks, out)
    value = out.reply_policy.to_device(b"y", "cuda:0")
    future: Future[Any] = Future()
    pending = pending_call(future, 1, "m.f", 0.0, observed=(hooks, out))
    pending.resolve(value, {})
    doubled: list[str] = []

    def twice(f: Future[Any]) -> None:
        f.value()
        doubled.append(caller_gpu.launch(caller_gpu.current_stream(0), "y * 2").label)

    future.then(twice).wait(5)
    assert doubled == ["y * 2"]
    stream = caller_gpu.default_stream(0)
    assert stream.items[0].label.startswith("wait for")
    assert caller_gpu.run(stream) == 0  # the reply's copy to the device has not run
    caller_gpu.run(caller.in_stream(0))
    assert caller_gpu.run(stream) == 2
