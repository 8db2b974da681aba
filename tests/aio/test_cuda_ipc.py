"""Same-host CUDA IPC above the device seam, on FakeDevices sharing one simulated host
(``FakeIpc``): the per-peer probe in the device-map hook's header field, handles in tags
with empty segments, the consumer ordered after the producer's event, releases told back,
a lost consumer's references dropped, and no leak over 1,000 calls."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.runtime.calls.pipeline import CallKind, IncomingCall, OutgoingCall, Pipeline
from asyncrpc.runtime.cuda import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.devices import GpuIdentity
from asyncrpc.runtime.cuda.fake import FakeIpc
from asyncrpc.runtime.cuda.ipc import FIELD as IPC_FIELD
from asyncrpc.runtime.cuda.ipc import IpcLinks, is_ipc_tag
from asyncrpc.runtime.cuda.maps import FIELD, DeviceMapHook
from asyncrpc.runtime.cuda.staging import StagedCopy, StagedTransfer

pytestmark = pytest.mark.timeout(10)

A, B = 0, 1  # two workers' ranks on one host
EMPTY = torch.empty(0, dtype=torch.uint8)  # what an IPC tensor's segment holds


def worker(
    host: FakeIpc, rank: int, *, probe: bool = True, boot: str = "boot", uuids: Any = None
) -> StagedTransfer:
    identity = GpuIdentity(boot, tuple(uuids or ("GPU-a", "GPU-b")))
    gpu = FakeDevices(2, identity, host)
    transfer = StagedTransfer(gpu)
    transfer.ipc = IpcLinks(gpu, lambda peer: peer != rank, probe, transfer.in_stream)
    return transfer


def probed(host: FakeIpc | None = None) -> tuple[StagedTransfer, StagedTransfer]:
    """Two workers on one host that offered, opened and answered each other's probe."""
    host = host or FakeIpc()
    a, b = worker(host, A), worker(host, B)
    assert a.ipc is not None
    assert b.ipc is not None
    b.ipc.field_in(A, a.ipc.field_out(B))  # a's request: its offer
    a.ipc.field_in(B, b.ipc.field_out(A))  # b's reply: its answer, and its own offer
    b.ipc.field_in(A, a.ipc.field_out(B))  # a's next request: its answer
    assert a.ipc.usable(B)
    assert b.ipc.usable(A)
    return a, b


def ipc(transfer: StagedTransfer) -> IpcLinks:
    assert transfer.ipc is not None
    return transfer.ipc


def gpu(transfer: StagedTransfer) -> FakeDevices:
    devices = transfer.devices
    assert isinstance(devices, FakeDevices)
    return devices


# -- the probe -------------------------------------------------------------------------------


def test_probe_turns_ipc_on_both_ways_only_after_each_peer_opened_the_other() -> None:
    host = FakeIpc()
    a, b = worker(host, A), worker(host, B)
    offer = ipc(a).field_out(B)
    assert offer is not None
    assert "o" in offer
    assert not ipc(a).usable(B)  # offered, not answered: staged meanwhile
    assert ipc(a).field_out(B) is None  # offered once
    ipc(b).field_in(A, offer)
    reply = ipc(b).field_out(A)
    assert reply is not None
    assert reply["a"] == 1
    assert "o" in reply
    ipc(a).field_in(B, reply)
    assert ipc(a).usable(B)
    assert not ipc(b).usable(A)
    ipc(b).field_in(A, ipc(a).field_out(B))
    assert ipc(b).usable(A)
    gc.collect()
    # The probes' handles were opened and dropped: told back, then nothing is left.
    ipc(a).field_in(B, ipc(b).field_out(A))
    ipc(b).field_in(A, ipc(a).field_out(B))
    assert host.live() == 0


@pytest.mark.parametrize("why", ["another boot", "unseen GPU", "driver refuses"])
def test_probe_that_fails_leaves_the_peer_on_staged_copies(why: str) -> None:
    host = FakeIpc()
    a = worker(host, A)
    b = worker(
        host, B, boot="other" if why == "another boot" else "boot",
        uuids=("GPU-x",) if why == "unseen GPU" else None,
    )  # fmt: skip
    host.refuse = why == "driver refuses"
    ipc(b).field_in(A, ipc(a).field_out(B))
    ipc(a).field_in(B, ipc(b).field_out(A))
    assert ipc(a).state(B) == "off"
    policy = a.policy({"cuda:0": "cuda:0"}, B)
    tag, host_copy = policy.to_host(FakeTensor(0, "x"))
    assert tag == "cuda:0"
    assert host_copy.fake_device is None


def test_no_offer_to_a_peer_on_another_host_or_to_itself() -> None:
    a = worker(FakeIpc(), A)
    assert ipc(a).field_out(A) is None  # itself: never (a process cannot open its handles)
    assert not ipc(a).usable(A)
    remote = IpcLinks(gpu(a), lambda peer: False)
    assert remote.field_out(B) is None
    assert not remote.usable(B)


def test_forced_ipc_needs_no_probe_but_still_only_same_host_peers() -> None:
    a = worker(FakeIpc(), A, probe=False)
    assert ipc(a).usable(B)
    assert not ipc(a).usable(A)
    assert ipc(a).field_out(B) is None


# -- ordering --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_handle_leaves_at_once_and_the_consumer_reads_after_the_producer() -> None:
    a, b = probed()
    producer = gpu(a).launch(gpu(a).default_stream(0), "writes x")
    copies = gpu(a).copies  # the probe's
    sent = a.policy({"cuda:0": "cuda:1"}, B)
    tag, tensor = sent.to_host(FakeTensor(0, "x"))
    assert is_ipc_tag(tag)
    assert tensor.fake_device == 0  # stays on the device: no copy, an empty segment
    assert a.ready(sent) is None  # nothing to wait for before writing the frame
    assert gpu(a).copies == copies
    received = b.policy({}, A)
    x = received.to_device(EMPTY, tag)
    assert x.fake_device == 1
    assert x.value == "x"
    first = b.before_use(received)
    assert first is not None
    reader = gpu(b).new_stream(1)
    with gpu(b).use_streams([reader]):
        first()
        kernel = gpu(b).launch(reader, "reads x")
    gpu(b).run(b.in_stream(1))
    assert gpu(b).run(reader) == 0  # the producer's kernel has not run
    gpu(a).run(gpu(a).default_stream(0))
    assert producer.done
    gpu(b).run(b.in_stream(1))
    gpu(b).run(reader)
    assert kernel.done


def test_memory_on_another_gpu_of_the_host_gets_a_peer_copy() -> None:
    host = FakeIpc()
    a = worker(host, A, uuids=("GPU-a", "GPU-b"))
    b = worker(host, B, uuids=("GPU-b", "GPU-a"))  # CUDA_VISIBLE_DEVICES reordered
    ipc(b).field_in(A, ipc(a).field_out(B))
    ipc(a).field_in(B, ipc(b).field_out(A))
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    b.policy({}, A).to_device(EMPTY, tag)  # GPU-a is b's cuda:1; the map says cuda:0
    labels = [item.label for item in b.in_stream(0).items]
    assert any(label.startswith("peer copy 1 -> 0") for label in labels)


def test_memory_opened_from_a_handle_goes_back_staged() -> None:
    a, b = probed()
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    x = b.policy({}, A).to_device(EMPTY, tag)
    echoed, host_copy = b.policy({"cuda:0": "cuda:0"}, A).to_host(x)  # an echo's reply
    assert echoed == "cuda:0"
    assert host_copy.value == "x"
    assert ipc(b).refused == 1


def test_a_handle_that_does_not_open_is_a_serialization_error() -> None:
    host = FakeIpc()
    a, b = probed(host)
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    host.refuse = True
    with pytest.raises(SerializationError, match="could not be opened"):
        b.policy({}, A).to_device(EMPTY, tag)
    with pytest.raises(SerializationError, match="IPC is off"):
        StagedTransfer(FakeDevices()).policy({}, A).to_device(EMPTY, tag)


def test_reply_shared_from_a_pool_stream_records_its_event_there() -> None:
    _a, b = probed()
    stream = gpu(b).new_stream(0)
    reply = b.policy({"cuda:0": "cuda:0"}, A)
    reply.streams[0] = stream  # the callee's leased stream (see test_cuda_callee)
    gpu(b).launch(stream, "writes y")
    reply.to_host(FakeTensor(0, "y"))
    (entry,) = [e for e in gpu(b).ipc.shared.values() if e.tensor.value == "y"]
    assert entry.event.stream is stream


# -- lifetime --------------------------------------------------------------------------------


def test_producer_keeps_the_block_until_the_consumer_freed_it_and_said_so() -> None:
    host = FakeIpc()
    a, b = probed(host)
    before = host.live()
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    x = b.policy({}, A).to_device(EMPTY, tag)
    assert ipc(a).outstanding(B) == 1
    ipc(a).field_in(B, ipc(b).field_out(A))  # b's next message: x is still held
    assert ipc(a).outstanding(B) == 1
    assert host.live() == before + 1
    del x
    gc.collect()
    told = ipc(b).field_out(A)
    assert told is not None
    assert len(told["r"]) == 1
    ipc(a).field_in(B, told)
    assert ipc(a).outstanding(B) == 0
    assert host.live() == before  # collected once nobody referenced it
    assert host.over_released == 0


def test_a_lost_consumer_references_are_dropped_and_the_memory_collected() -> None:
    host = FakeIpc()
    a, b = probed(host)
    held = []
    for value in range(3):
        tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, value))
        held.append(b.policy({}, A).to_device(EMPTY, tag))  # b dies holding them
    assert host.referenced() >= 3
    ipc(a).on_peer_lost(B)
    assert ipc(a).outstanding(B) == 0
    assert host.live() == sum(1 for e in host.shared.values() if e.owner == id(gpu(b)))
    assert ipc(a).state(B) == "unknown"  # a new incarnation is probed again


def test_a_thousand_calls_leave_nothing_shared() -> None:
    host = FakeIpc()
    a, b = probed(host)
    released = ipc(a).released  # the probe's, if told already
    for call in range(1000):
        tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, call))
        y = b.policy({}, A).to_device(EMPTY, tag)
        assert y.value == call
        del y  # the callee is done with it; its reply tells the caller
        ipc(a).field_in(B, ipc(b).field_out(A))
    ipc(b).field_in(A, ipc(a).field_out(B))
    assert ipc(a).outstanding(B) == 0
    assert host.live() == 0
    assert host.over_released == 0
    assert ipc(a).shared == 1000
    assert ipc(a).released - released in (1000, 1001)  # and the probe's handle


# -- through the device-map hook ------------------------------------------------------------


def test_hook_carries_offer_answer_and_releases_in_request_and_reply_headers() -> None:
    host = FakeIpc()
    caller, callee = worker(host, A), worker(host, B)
    caller_hooks = Pipeline([DeviceMapHook({"w1": {"cuda:0": "cuda:0"}}, caller)])
    callee_hooks = Pipeline([DeviceMapHook(None, callee)])

    def call() -> tuple[OutgoingCall, IncomingCall]:
        out = OutgoingCall(CallKind.SYNC, "w0", "w1", B, print, "builtins.print", (), {})
        hooks = caller_hooks.active_hooks()
        Pipeline.prepare(hooks, out)
        served = IncomingCall("w0", A, "w1", 1, "builtins.print", False, dict(out.headers))
        callee_hooks.receiving(served)
        callee_hooks.replying(served, True, None)
        Pipeline.completed(hooks, out, served.reply_headers or None, None)
        return out, served

    first, served = call()
    assert "o" in first.headers[IPC_FIELD]
    assert served.reply_headers[IPC_FIELD]["a"] == 1
    assert ipc(caller).usable(B)
    second, _ = call()
    assert second.headers[IPC_FIELD]["a"] == 1  # the answer to the callee's own offer
    assert ipc(callee).usable(A)
    third, _ = call()
    assert isinstance(third.policy.devices, StagedCopy)
    assert third.policy.devices.peer == B
    assert FIELD in third.headers


def test_hook_debug_info_counts_handles() -> None:
    a, _ = probed()
    a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    info = DeviceMapHook({"w1": {"cuda:0": "cuda:0"}}, a).debug_info()
    assert info["cuda_ipc_shared"] == 1
    assert info["cuda_staged_out"] == 0
    assert info["device_maps"] == {"w1": {"cuda:0": "cuda:0"}}
