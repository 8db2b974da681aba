"""Unit tests of asyncrpc.runtime.calls.pipeline: hook order, activity, wrapping, failures."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from asyncrpc.runtime.calls.pipeline import CallHook, IncomingCall, OutgoingCall, Pipeline


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
    return OutgoingCall("sync", "a", "b", 1, print, "builtins.print", (1,), {})


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
    with caplog.at_level(logging.ERROR, logger="asyncrpc.pipeline"):
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
