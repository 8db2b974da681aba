"""The backward hop's own wire format (asyncrpc/autograd/hopwire.py): round trips, what
it refuses to code, and malformed payloads."""

from __future__ import annotations

import msgpack
import pytest
import torch

from asyncrpc.autograd.hopwire import dump_hop, dump_hop_reply, load_hop, load_hop_reply
from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde.tensors import SMALL_TENSOR_BYTES

CONTEXT = (3 << 48) | 17
CREDIT = (0, 5, 1 << 62)


def _owners(segments: list[tuple[memoryview, str]]) -> list[object]:
    # What the receiving frame gives: one writable buffer per segment, bytes copied.
    return [bytearray(bytes(view)) for view, _ in segments]


def _same(a: list[tuple[int, list[object]]], b: list[tuple[int, list[object]]]) -> None:
    assert [mid for mid, _ in a] == [mid for mid, _ in b]
    for (_, left), (_, right) in zip(a, b, strict=True):
        assert len(left) == len(right)
        for x, y in zip(left, right, strict=True):
            if x is None:
                assert y is None
                continue
            assert isinstance(x, torch.Tensor)
            assert isinstance(y, torch.Tensor)
            assert x.dtype == y.dtype
            assert x.shape == y.shape
            assert torch.equal(x, y)
            assert not y.requires_grad


def test_request_round_trip_with_small_large_and_missing_gradients() -> None:
    small = torch.randn(32, 64)
    large = torch.randn(256, 64)  # 64 KiB: a segment beside the payload
    assert large.numel() * 4 > SMALL_TENSOR_BYTES
    strided = torch.randn(64, 32, dtype=torch.float64).t()  # a transposed view
    batches = [((1 << 48) | 7, [small, None, large]), ((1 << 48) | 9, [strided])]
    coded = dump_hop((CONTEXT, batches, CREDIT, 1))
    assert coded is not None
    payload, segments, keep = coded
    assert len(segments) == 1
    assert keep
    context_id, loaded, credit, caller = load_hop(payload, _owners(segments))
    assert (context_id, credit, caller) == (CONTEXT, CREDIT, 1)
    _same(batches, loaded)
    assert loaded[1][1][0].stride() == strided.stride()


def test_request_without_credit() -> None:
    coded = dump_hop((CONTEXT, [(4, [torch.ones(3)])], None, 2))
    assert coded is not None
    assert load_hop(coded[0], [])[2] is None


def test_reply_round_trips() -> None:
    coded = dump_hop_reply(1 << 61)
    assert coded is not None
    assert load_hop_reply(coded[0], []) == 1 << 61
    grads = [(11, [torch.arange(6.0).view(2, 3), None])]
    coded = dump_hop_reply((grads, 123))
    assert coded is not None
    batches, amount = load_hop_reply(coded[0], _owners(coded[1]))
    assert amount == 123
    _same(grads, batches)


@pytest.mark.parametrize(
    "grad",
    [
        torch.randn(4, requires_grad=True),  # only create_graph would send one: pickled
        torch.nn.Parameter(torch.randn(4)),  # a subclass
        torch.randn(4, 4).to_sparse(),
        torch.randn(4, device="meta"),
    ],
    ids=["requires_grad", "parameter", "sparse", "meta"],
)
def test_what_it_cannot_say_goes_pickled(grad: torch.Tensor) -> None:
    assert dump_hop((CONTEXT, [(1, [grad])], CREDIT, 0)) is None
    assert dump_hop_reply(([(1, [grad])], 5)) is None


def test_replies_of_other_shapes_go_pickled() -> None:
    assert dump_hop_reply(None) is None
    assert dump_hop_reply(True) is None  # an int subclass: not this format's int
    assert dump_hop_reply(([(1, [torch.ones(1)])],)) is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used by msgpack
        msgpack.packb([1, 2, 3]),  # three fields
        msgpack.packb([1.5, 0, None, []]),  # a float context id
        msgpack.packb([1, 0, [1, 2], []]),  # credit of two
        msgpack.packb([1, 0, None, [[1]]]),  # a batch without gradients
        msgpack.packb([1, 0, None, [[1, ["x"]]]]),  # a gradient that is a string
        msgpack.packb([1, 0, None, [[1, [b"\x00"]]]]),  # truncated small tensor
        msgpack.packb([1, 0, None, [[1, [[0, "float32", [4], [1], 0]]]]]),  # no segment
        msgpack.packb([1, 0, None, [[1, [[0, "float32", [4], [1, 1], 0]]]]]),  # bad layout
        msgpack.packb([1, 0, None, [[1, [[0, "nosuch", [4], [1], 0]]]]]),  # bad dtype
    ],
)
def test_malformed_requests_raise_serialization_error(payload: bytes) -> None:
    with pytest.raises(SerializationError):
        load_hop(payload, [])


def test_a_gradient_past_its_segment_raises() -> None:
    payload = msgpack.packb([1, 0, None, [[1, [[0, "float32", [1000], [1], 0]]]]])
    with pytest.raises(SerializationError):
        load_hop(payload, [bytearray(16)])


def test_malformed_replies_raise_serialization_error() -> None:
    for payload in (msgpack.packb("x"), msgpack.packb([[], 1, 2]), msgpack.packb([[], "a"])):
        with pytest.raises(SerializationError):
            load_hop_reply(payload, [])
