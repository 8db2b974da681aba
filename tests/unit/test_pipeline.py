"""Unit tests of asyncrpc.runtime.calls.pipeline: hook order, activity, wrapping, failures."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde import Serializer
from asyncrpc.runtime.calls.pipeline import (
    CallHook,
    CallKind,
    CallTensors,
    IncomingCall,
    ItemsIn,
    OutgoingCall,
    Pipeline,
    StreamLinks,
)


class Recorder(CallHook):
    def __init__(self, name: str, log: list[str], active: bool = True) -> None:
        self.name, self.log, self._active = name, log, active

    def active(self) -> bool:
        return self._active

    def outgoing(self, call: OutgoingCall) -> None:
        self.log.append(f"{self.name}.outgoing")
        call.headers[self.name] = len(call.tensors)

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        self.log.append(f"{self.name}.completed:{headers}:{type(error).__name__}")

    def incoming(self, call: IncomingCall) -> None:
        self.log.append(f"{self.name}.incoming")
        call.wrap(lambda fn: lambda *a: [self.name, *fn(*a)])

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        call.reply_headers[self.name] = ok


def outgoing_call() -> OutgoingCall:
    return OutgoingCall(CallKind.SYNC, "a", "b", 1, print, "builtins.print", (1,), {})


def incoming_call(headers: dict[str, Any] | None = None) -> IncomingCall:
    return IncomingCall("a", 0, "b", 9, "m.f", False, headers or {})


def test_Pipeline_empty_is_false_and_has_no_active_hooks() -> None:
    pipeline = Pipeline()
    assert not pipeline
    assert pipeline.active_hooks() == ()
    assert not pipeline.serves({"p": 1})


def test_Pipeline_outgoing_runs_active_hooks_in_order() -> None:
    log: list[str] = []
    first, idle, last = Recorder("a", log), Recorder("b", log, False), Recorder("c", log)
    pipeline = Pipeline([first, idle, last])
    hooks = pipeline.active_hooks()
    assert hooks == (first, last)
    call = outgoing_call()
    call.tensors.append(object())
    Pipeline.outgoing(hooks, call)
    assert call.headers == {"a": 1, "c": 1}
    Pipeline.completed(hooks, call, {"x": 1}, None)
    assert log == [
        "a.outgoing",
        "c.outgoing",
        "a.completed:{'x': 1}:NoneType",
        "c.completed:{'x': 1}:NoneType",
    ]


def test_Pipeline_completed_logs_a_failing_hook_and_runs_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []

    class Broken(CallHook):
        def completed(self, call: OutgoingCall, headers: Any, error: Any) -> None:
            raise RuntimeError("hook bug")

    hooks = (Broken(), Recorder("b", log))
    with caplog.at_level(logging.ERROR, logger="asyncrpc.runtime.calls.pipeline"):
        Pipeline.completed(hooks, outgoing_call(), None, TimeoutError())
    assert log == ["b.completed:None:TimeoutError"]
    assert "hook bug" in caplog.text


def test_Pipeline_serves_requests_with_fields_or_when_a_hook_serves_all() -> None:
    class ServesAll(CallHook):
        on = False

        def serves_all(self) -> bool:
            return self.on

    hook = ServesAll()
    pipeline = Pipeline([hook])
    assert pipeline.serves({"p": 1})
    assert not pipeline.serves(None)
    hook.on = True
    assert pipeline.serves(None)


def test_Pipeline_incoming_wrappers_nest_first_hook_outermost() -> None:
    log: list[str] = []
    pipeline = Pipeline([Recorder("a", log), Recorder("b", log)])
    call = incoming_call({"a": 1})
    pipeline.incoming(call)
    run = call.wrapped(lambda x: [x])
    assert run("fn") == ["a", "b", "fn"]
    pipeline.replying(call, True, None)
    assert call.reply_headers == {"a": True, "b": True}


def test_Pipeline_add_and_remove_keep_order_and_skip_duplicates() -> None:
    log: list[str] = []
    a, b = Recorder("a", log), Recorder("b", log)
    pipeline = Pipeline([a])
    pipeline.add(b)
    pipeline.add(a)
    assert pipeline.hooks == (a, b)
    pipeline.remove(a)
    assert pipeline.hooks == (b,)


# -- stages a hook overrides ------------------------------------------------------------


class OnlyCompleted(CallHook):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        self.log.append("completed")


def test_CallHook_stages_are_those_its_class_overrides() -> None:
    assert OnlyCompleted.stages == {"completed"}
    assert Recorder.stages == {"active", "outgoing", "completed", "incoming", "replying"}
    assert CallHook.stages == frozenset()


def test_Pipeline_calls_a_hook_only_for_the_stages_it_overrides() -> None:
    log: list[str] = []

    class Spy(OnlyCompleted):
        def __getattribute__(self, name: str) -> Any:
            if name in ("prepare", "outgoing", "ready", "receiving", "incoming", "reply_ready"):
                log.append(f"looked up {name}")
            return super().__getattribute__(name)

    spy = Spy(log)
    pipeline = Pipeline([spy])
    hooks = pipeline.active_hooks()
    call = outgoing_call()
    Pipeline.prepare(hooks, call)
    Pipeline.outgoing(hooks, call)
    assert Pipeline.ready(hooks, call) is None
    Pipeline.completed(hooks, call, None, None)
    served = incoming_call()
    pipeline.receiving(served)
    pipeline.incoming(served)
    assert pipeline.reply_ready(served) is None
    assert log == ["completed"]
    assert pipeline.overriding("completed") == (spy,)
    assert pipeline.overriding("outgoing") == ()


class ItemFields(CallHook):
    """Adds a field to each stream item, and notes the items received with fields."""

    def __init__(self, key: str, log: list[Any]) -> None:
        self.key, self.log = key, log

    def item_sent(self, call: IncomingCall, grads: list[torch.Tensor]) -> dict[str, Any] | None:
        return {self.key: len(grads)} if grads else None

    def item_received(
        self, call: OutgoingCall, headers: dict[str, Any], grads: list[torch.Tensor]
    ) -> None:
        self.log.append((self.key, headers, len(grads)))


class Holds(CallHook):
    """Holds each stream item on ``wait`` (None: its items never wait), saying it holds
    ``held`` bytes by handle, and gives the items it consumes ``policy``."""

    def __init__(self, wait: Any, policy: ItemsIn | None = None, held: int = 0) -> None:
        self.wait, self.policy, self.held = wait, policy, held

    def items_ready(self, call: IncomingCall) -> Any:
        return None if self.wait is None else (lambda: (self.wait, self.held))

    def items_in(self, peer: int) -> ItemsIn | None:
        return self.policy


def test_Pipeline_items_ready_is_asked_once_per_stream_and_combines_the_hooks() -> None:
    served = incoming_call()
    assert Pipeline([Holds(None), OnlyCompleted([])]).items_ready(served) is None
    one = Holds("w")
    ready = Pipeline([Holds(None), one]).items_ready(served)
    assert ready is not None
    assert ready() == ("w", 0)  # one hook's callable: nothing in between per item
    log: list[str] = []

    async def wait(name: str) -> None:
        log.append(name)

    both = Pipeline([Holds(wait("a"), held=3), Holds(wait("b"), held=4)]).items_ready(served)
    assert both is not None
    waits, held = both()
    assert held == 7  # the bytes both hooks' items hold by handle
    asyncio.run(waits)  # type: ignore[arg-type]
    assert log == ["a", "b"]  # in the hooks' order


class Links(CallHook):
    """Adds ``key`` to the stream frames to every peer, and takes it out of theirs."""

    def __init__(self, key: str, log: list[Any]) -> None:
        self.key, self.log = key, log

    def stream_links(self, peer: int) -> StreamLinks | None:
        return StreamLinks()

    def stream_received(self, peer: int, headers: dict[str, Any]) -> None:
        self.log.append((peer, headers.pop(self.key, None)))


def test_Pipeline_stream_links_are_the_first_hooks_and_each_hook_takes_its_fields() -> None:
    assert Pipeline([Holds(None)]).stream_links(1) is None
    log: list[Any] = []
    first = Links("x", log)
    links = Pipeline([Holds(None), first, Links("y", log)]).stream_links(1)
    assert isinstance(links, StreamLinks)
    assert links.fields() is None  # the base adds nothing and owes nothing
    assert links.owed() is None
    headers = {"x": 1, "y": 2, "z": 3}
    Pipeline([first, Links("y", log)]).stream_received(4, headers)
    assert log == [(4, 1), (4, 2)]
    assert headers == {"z": 3}  # what no hook owns is left for the others


def test_Pipeline_items_in_is_the_first_hooks_policy() -> None:
    first, second = ItemsIn(), ItemsIn()
    assert Pipeline([Holds(None), Holds(None)]).items_in(3) is None
    assert Pipeline([Holds(None, first), Holds(None, second)]).items_in(3) is first
    assert first.take() is None  # the base reads items as they are


def test_Pipeline_item_fields_merge_the_hooks_fields_or_give_none() -> None:
    log: list[Any] = []
    pipeline = Pipeline([ItemFields("a", log), OnlyCompleted(log), ItemFields("b", log)])
    assert ItemFields.stages == {"item_sent", "item_received"}
    served = incoming_call()
    assert pipeline.item_fields(served, []) is None  # no hook had a field: no map at all
    grad = torch.ones(1, requires_grad=True)
    assert pipeline.item_fields(served, [grad]) == {"a": 1, "b": 1}
    Pipeline.item_received(pipeline.hooks, outgoing_call(), {"a": 1}, [grad])
    assert log == [("a", {"a": 1}, 1), ("b", {"a": 1}, 1)]


# -- tensor policies -------------------------------------------------------------------


def test_CallTensors_untracked_notes_tensors_and_sends_none_as_forced_segments() -> None:
    policy = CallTensors()
    small = torch.ones(2, requires_grad=True)
    assert policy.met(small) is False
    assert policy.seen == [small]
    policy.exported(small)
    assert policy.grads is None


def test_CallTensors_tracking_lists_grads_in_order_without_forcing_segments() -> None:
    policy = CallTensors()
    policy.track_grads()
    a, b, plain = (
        torch.ones(1, requires_grad=True),
        torch.ones(2, requires_grad=True),
        torch.ones(3),
    )
    # Small tensors requiring grad ride inside the pickle like any other: both sides list
    # them in the order they are first pickled (exported / imported), not by segment.
    assert not policy.met(a)
    assert not policy.met(b)
    assert not policy.met(plain)
    for tensor in (b, plain, a):
        policy.exported(tensor)
    assert policy.grads == [b, a]


def test_CallTensors_without_a_device_policy_refuses_tensors_off_the_cpu() -> None:
    with pytest.raises(SerializationError, match="only CPU and CUDA"):
        CallTensors().to_host(torch.empty(1, device="meta"))


def test_serializer_with_tracked_grads_lists_them_on_both_sides() -> None:
    serializer = Serializer()
    sender, receiver = CallTensors(), CallTensors()
    sender.track_grads()
    receiver.track_grads()
    small = torch.ones(2, requires_grad=True)
    big = torch.zeros(8192, requires_grad=True)  # 32 KiB: a segment
    payload, segments, _keep, _ = serializer.dumps([big, torch.ones(1), small, big], policy=sender)
    assert len(segments) == 1  # `big`, once; the small one rides inside the pickle
    assert sender.grads == [big, small]
    got = serializer.loads(payload, [bytearray(view) for view, _ in segments], policy=receiver)
    assert receiver.grads == [got[0], got[2]]
    assert got[0] is got[3]


def test_serializer_without_policy_inlines_small_grads() -> None:
    _payload, segments, _keep, _ = Serializer().dumps([torch.ones(2, requires_grad=True)])
    assert segments == []


def test_call_track_grads_tracks_the_reply_too() -> None:
    call = outgoing_call()
    assert call.grads == []
    assert call.reply_grads == []
    call.track_grads()
    assert call.policy.grads == []
    assert call.reply_policy.grads == []


# -- ready -----------------------------------------------------------------------------


class Gate(CallHook):
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def ready(self, call: OutgoingCall) -> Any:
        return self._wait()

    def reply_ready(self, call: IncomingCall) -> Any:
        return self._wait()

    async def _wait(self) -> None:
        self.log.append(self.name)


def test_Pipeline_ready_awaits_every_hook_in_order() -> None:
    log: list[str] = []
    first, second = Gate(log, "first"), Gate(log, "second")
    pipeline = Pipeline([first, OnlyCompleted(log), second])
    ready = Pipeline.ready(pipeline.active_hooks(), outgoing_call())
    assert ready is not None
    assert log == []
    asyncio.run(_await(ready))
    assert log == ["first", "second"]
    reply_ready = pipeline.reply_ready(incoming_call())
    assert reply_ready is not None
    asyncio.run(_await(reply_ready))
    assert log == ["first", "second", "first", "second"]


def test_Pipeline_ready_of_one_hook_is_its_own_awaitable() -> None:
    log: list[str] = []
    ready = Pipeline.ready((Gate(log, "only"),), outgoing_call())
    assert asyncio.iscoroutine(ready)
    asyncio.run(_await(ready))
    assert log == ["only"]


async def _await(ready: Any) -> None:
    await ready
