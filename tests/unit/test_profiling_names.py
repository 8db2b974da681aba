"""Span names as torch makes them, and moving recorded rows between clocks (no workers)."""

from __future__ import annotations

import pytest
import torch

from asyncrpc.profiling import recorder
from asyncrpc.profiling.names import call_name, function_name, is_torch_op, rpc_span_name
from asyncrpc.profiling.recorder import Recording, centred_offset, relabel


class _Holder:
    def method(self) -> None: ...


def _udf() -> None: ...


def test_function_name_is_torchs_name_of_the_function() -> None:
    assert function_name(torch.add) == "aten::add"
    assert function_name(torch.mul) == "aten::mul"
    assert function_name(_udf) == "_udf"
    assert function_name(_Holder.method) == "_Holder.method"
    assert is_torch_op(torch.add)
    assert not is_torch_op(_udf)


def test_call_name_keeps_a_name_the_caller_gave() -> None:
    default = f"{__name__}._udf"
    assert call_name(default, default, _udf) == "_udf"
    assert call_name("RRef.to_here", default, _udf) == "RRef.to_here"
    assert call_name("RRef._get_type", default, _udf) == "_rref_typeof_on_owner"


def test_rpc_span_name_format() -> None:
    assert rpc_span_name("remote", "aten::add", "a", "b") == "rpc_remote#aten::add(a -> b)"


def test_relabel_renames_shifts_and_marks_rows_recorded_by_the_sender() -> None:
    rows = [["f", 0.0, 10.0, 7, -1, None, 0], ["g", 2.0, 3.0, 7, 5, [[1]], 64]]
    moved = relabel(rows, lambda name: f"x#{name}", 100.0, 2)
    assert moved == [["x#f", 100.0, 110.0, 7, 2, None, 0], ["x#g", 102.0, 103.0, 7, 5, [[1]], 64]]


def test_centred_offset_places_rows_in_the_middle_of_the_span() -> None:
    rows = [["f", 0.0, 4.0, 1, -1, None, 0], ["g", 1.0, 6.0, 1, -1, None, 0]]
    assert centred_offset(10.0, 20.0, rows) == 12.0  # 6 µs of rows in a 10 µs span
    assert centred_offset(10.0, 12.0, rows) == 10.0  # longer than the span: at its start
    assert centred_offset(10.0, 20.0, []) == 15.0


def test_recording_keeps_at_most_max_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "MAX_EVENTS", 2)
    recording = Recording("f")
    row = ["e", 0.0, 1.0, 1, -1, None, 0]
    recording.add([row] * 3)
    assert recording.as_rows()[1:] == [row] * 2
    assert recording.dropped == 1
    assert recording.as_rows()[0][0] == "f"  # the function's own row first
