"""Same-host CUDA IPC above the device seam, on FakeDevices sharing one simulated host
(``FakeIpc``): the per-peer probe in the device-map hook's header field, handles in tags
with empty segments, the consumer ordered after the producer's event, releases told back,
a lost consumer's references dropped, and no leak over 1,000 calls."""

from __future__ import annotations

import asyncio
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


def settle(*transfers: StagedTransfer) -> None:
    """Run every queued copy of these workers' fake GPUs (producers' first: the consumers'
    copy-in streams wait for their events)."""
    for _ in range(2):
        for transfer in transfers:
            for device in range(2):
                gpu(transfer).run(gpu(transfer).default_stream(device))
                gpu(transfer).run(transfer.in_stream(device))


def by_handle(
    transfer: StagedTransfer, tensor: Any, peer: int, device_map: dict[str, str] | None = None
) -> str:
    """``tensor``'s tag in a message to ``peer``, sent the way the send gate lets it go:
    once the producer's fill into the block has run."""
    policy = transfer.policy(device_map or {"cuda:0": "cuda:0"}, peer)
    tag, _ = policy.to_host(tensor)
    for _, event in policy.shared:
        gpu(transfer).run(event.stream)
    assert transfer.ready(policy) is None
    return str(tag)


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
    settle(a, b)
    # The probes were copied out of their blocks and named back: the blocks are free, and
    # stay exported and mapped (one each way) for the next messages.
    ipc(a).field_in(B, ipc(b).field_out(A))
    ipc(b).field_in(A, ipc(a).field_out(B))
    assert ipc(a).outstanding(B) == ipc(b).outstanding(A) == 0
    assert host.live() == host.referenced() == 2


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
async def test_handle_leaves_once_the_fill_ran_and_the_consumer_needs_no_wait() -> None:
    a, b = probed()
    producer = gpu(a).launch(gpu(a).default_stream(0), "writes x")
    copies = gpu(a).copies
    sent = a.policy({"cuda:0": "cuda:1"}, B)
    tag, tensor = sent.to_host(FakeTensor(0, "x"))
    assert is_ipc_tag(tag)
    assert tensor.fake_device == 0  # stays on the device: no copy, an empty segment
    assert gpu(a).copies == copies + 1  # one copy on the device, for sharing; none to host
    assert a.staged_out == 0
    held = a.ready(sent)
    assert held is not None  # the fill into the block waits behind the producer's kernel
    waiting = asyncio.ensure_future(held)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    gpu(a).run(gpu(a).default_stream(0))  # the kernel, then the fill
    assert producer.done
    await asyncio.wait_for(waiting, 1)
    received = b.policy({}, A)
    x = received.to_device(EMPTY, tag)
    assert x.fake_device == 1
    assert x.value == "x"
    assert gpu(b).waits == 0  # nothing to wait on: the bytes were in the block already
    # A second message whose fill is already done when it is framed is not held at all.
    again = a.policy({"cuda:0": "cuda:1"}, B)
    again.to_host(FakeTensor(0, "y"))
    gpu(a).run(gpu(a).default_stream(0))
    assert a.ready(again) is None


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


def test_a_received_tensor_is_the_consumers_own_and_goes_back_by_handle() -> None:
    # An echo: what the consumer opened was copied into memory of its own, so its reply can
    # go by handle again (torch cannot share memory a process opened from a handle).
    a, b = probed()
    tag = by_handle(a, FakeTensor(0, "x"), B)
    x = b.policy({}, A).to_device(EMPTY, tag)
    settle(b)
    reply = b.policy({"cuda:0": "cuda:0"}, A)
    back, same = reply.to_host(x)  # the echo's reply
    assert is_ipc_tag(back)
    assert same is x
    assert ipc(b).refused == 0
    settle(b)
    y = a.policy({}, B).to_device(EMPTY, back)
    assert y.value == "x"


def test_memory_the_driver_will_not_share_goes_staged() -> None:
    a, _ = probed()
    tag, host_copy = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x", opened=True))
    assert tag == "cuda:0"
    assert host_copy.value == "x"
    assert ipc(a).refused == 1


def test_the_consumer_reads_the_bytes_as_they_were_sent() -> None:
    # The tensor is copied into the block on the producer's stream: what the consumer
    # copies out is that, not the producer's tensor, so later writes cannot reach it.
    a, b = probed()
    x = FakeTensor(0, "x")
    policy = a.policy({"cuda:0": "cuda:0"}, B)
    tag, _ = policy.to_host(x)
    labels = [item.label for item in gpu(a).default_stream(0).items]
    assert labels[-1].startswith("fill block")
    x.value = "written later"
    settle(a)
    assert a.ready(policy) is None
    assert b.policy({}, A).to_device(EMPTY, tag).value == "x"


def test_a_handle_that_does_not_open_is_a_serialization_error() -> None:
    host = FakeIpc()
    a, b = probed(host)
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    host.refuse = True
    with pytest.raises(SerializationError, match="could not be opened"):
        b.policy({}, A).to_device(EMPTY, tag)
    with pytest.raises(SerializationError, match="IPC is off"):
        StagedTransfer(FakeDevices()).policy({}, A).to_device(EMPTY, tag)


def test_reply_shared_from_a_pool_stream_fills_its_block_there() -> None:
    _a, b = probed()
    stream = gpu(b).new_stream(0)
    reply = b.policy({"cuda:0": "cuda:0"}, A)
    reply.streams[0] = stream  # the callee's leased stream (see test_cuda_callee)
    gpu(b).launch(stream, "writes y")
    reply.to_host(FakeTensor(0, "y"))
    labels = [item.label for item in stream.items]
    assert labels[0] == "writes y"
    assert labels[1].startswith("fill block")


# -- lifetime --------------------------------------------------------------------------------


def test_a_block_is_lent_until_the_consumers_copy_is_done_and_it_said_so() -> None:
    host = FakeIpc()
    a, b = probed(host)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))  # the probes' blocks, named back
    ipc(b).field_in(A, ipc(a).field_out(B))
    made = ipc(a).blocks.made
    tag = by_handle(a, FakeTensor(0, "x"), B)
    x = b.policy({}, A).to_device(EMPTY, tag)
    assert ipc(a).outstanding(B) == 1
    ipc(a).field_in(B, ipc(b).field_out(A))  # b's next message: its copy has not run yet
    assert ipc(a).outstanding(B) == 1
    second = by_handle(a, FakeTensor(0, "y"), B)
    assert ipc(a).blocks.made == made + 1  # the lent one is not filled again meanwhile
    settle(a, b)  # the consumer's copies out
    told = ipc(b).field_out(A)
    assert told is not None
    assert len(told["r"]) == 1
    assert x.value == "x"  # the consumer's own copy
    ipc(a).field_in(B, told)
    assert ipc(a).outstanding(B) == 1  # "y" is still out: b has not opened it
    live = host.live()
    a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "z"))
    assert host.live() == live  # a free block was filled again, none exported
    assert b.policy({}, A).to_device(EMPTY, second).value == "y"
    assert host.over_released == 0


def test_a_block_whose_last_fill_has_not_run_is_not_filled_again() -> None:
    # A probe's message does not wait for its fill: should the peer name its block back
    # before that fill ran, the block is not lent again until it has.
    host = FakeIpc()
    a, b = probed(host)
    settle(b)  # b copied the probe out; a's probe fill has not run
    ipc(a).field_in(B, ipc(b).field_out(A))
    assert ipc(a).outstanding(B) == 0
    made = ipc(a).blocks.made
    by_handle(a, FakeTensor(0, "x"), B)
    assert ipc(a).blocks.made == made + 1  # a new block, not the probe's


def test_a_lost_consumer_references_are_dropped_and_the_memory_collected() -> None:
    host = FakeIpc()
    a, b = probed(host)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))
    # Three blocks, opened there and named back.
    tags = [a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, v))[0] for v in "abc"]
    for tag in tags:
        b.policy({}, A).to_device(EMPTY, tag)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))
    assert ipc(a).outstanding(B) == 0
    for value in range(3):  # in flight again when b dies
        tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, value))
        b.policy({}, A).to_device(EMPTY, tag)
    mine = [h for h, e in host.shared.items() if e.owner == id(gpu(a))]
    assert len(mine) == 3  # the probe's block (free again, so reused) and two more
    ipc(a).on_peer_lost(B)
    assert ipc(a).outstanding(B) == 0
    assert not any(e.owner == id(gpu(a)) for e in host.shared.values())
    assert host.over_released == 0
    assert ipc(a).state(B) == "unknown"  # a new incarnation is probed again


def test_a_block_opened_but_never_named_back_is_not_dropped_twice() -> None:
    # Only the consumer knows it opened a block until it names one back: the producer
    # drops no reference it cannot prove was taken (torch's counter would go below zero).
    host = FakeIpc()
    a, b = probed(host)
    tag, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))
    b.policy({}, A).to_device(EMPTY, tag)  # opened, and b dies before naming it back
    ipc(a).on_peer_lost(B)
    assert host.over_released == 0


def test_a_lost_producer_s_blocks_are_unmapped() -> None:
    host = FakeIpc()
    a, b = probed(host)
    tag = by_handle(a, FakeTensor(0, "x"), B)
    y = b.policy({}, A).to_device(EMPTY, tag)
    referenced = host.referenced()
    ipc(b).on_peer_lost(A)
    assert host.referenced() < referenced
    assert y.value == "x"  # copied out: still valid


def test_a_thousand_calls_reuse_one_block() -> None:
    host = FakeIpc()
    a, b = probed(host)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))  # the probe's block, named back
    released = ipc(a).released
    for call in range(1000):
        tag = by_handle(a, FakeTensor(0, call), B)
        y = b.policy({}, A).to_device(EMPTY, tag)
        assert y.value == call
        settle(a, b)  # the copies ran; the reply names the block back
        ipc(a).field_in(B, ipc(b).field_out(A))
    ipc(b).field_in(A, ipc(a).field_out(B))
    assert ipc(a).outstanding(B) == 0
    assert ipc(a).blocks.made == 1  # the probe's block, reused by every call
    assert gpu(b).waits == 0  # no message made the consumer wait on the producer
    assert host.over_released == 0
    assert ipc(a).shared == 1000
    assert ipc(a).released - released == 1000


def test_a_block_filled_again_holds_its_frame_until_the_new_fill_ran() -> None:
    # Each message through the block waits for its own fill (behind the producer's
    # kernel) before it leaves, and the consumer reads that message's bytes.
    host = FakeIpc()
    a, b = probed(host)
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))  # the probe's block, named back
    for value in ("x", "y"):
        producer = gpu(a).launch(gpu(a).default_stream(0), f"writes {value}")
        policy = a.policy({"cuda:0": "cuda:0"}, B)
        tag, _ = policy.to_host(FakeTensor(0, value))
        assert a.ready(policy) is not None  # held: asked, never awaited, nothing left
        settle(a)
        assert producer.done
        assert a.ready(policy) is None
        assert b.policy({}, A).to_device(EMPTY, tag).value == value
        settle(b)
        ipc(a).field_in(B, ipc(b).field_out(A))  # named back: free for the next message
    assert ipc(a).blocks.made == 1


def test_no_block_within_the_bound_sends_the_tensor_staged() -> None:
    host = FakeIpc()
    a, b = probed(host)
    ipc(a).blocks.limit = ipc(a).blocks.stats()["cuda_ipc_block_bytes"]  # what it has
    settle(a, b)
    ipc(a).field_in(B, ipc(b).field_out(A))
    first, _ = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "x"))  # the free one
    assert is_ipc_tag(first)
    second, host_copy = a.policy({"cuda:0": "cuda:0"}, B).to_host(FakeTensor(0, "y"))
    assert second == "cuda:0"
    assert host_copy.value == "y"
    assert ipc(a).stats()["cuda_ipc_full"] == 1


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
