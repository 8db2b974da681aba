"""Unit tests of out-of-band tensors (asyncrpc.protocol.serde.tensors through Serializer)."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch
    from torch import nn

    from asyncrpc.errors import SerializationError
    from asyncrpc.protocol.serde import Serializer
    from asyncrpc.protocol.serde.tensors import (
        SMALL_TENSOR_BYTES,
        TENSOR_PID,
        import_tensor,
        rebuild_small_tensor,
        reduce_small_tensor,
    )
    from asyncrpc.runtime.calls.pipeline import CallTensors
    from asyncrpc.runtime.cuda.maps import HostCopy
    from tests.unit import _serde_helpers as helpers

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
PLAIN_DTYPES = [dtype for dtype in ALL_DTYPES if dtype not in QUANTIZED]


@pytest.fixture
def serializer() -> Serializer:
    # Every tensor as a segment, however small: most tests here are about segments.
    return Serializer(inline_tensor_bytes=-1)


def roundtrip(serializer: Serializer, obj: object, **kwargs: Any) -> helpers.Sent:
    return helpers.wire_roundtrip(serializer, obj, **kwargs)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (works for dtypes with no arithmetic, e.g. float8)."""
    itemsize = torch.empty(0, dtype=torch.uint8).view(dtype).element_size()
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as bytes, in row-major order (numpy is not available)."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, for dtypes torch.equal does not implement (float8, complex32...)."""
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


def segment_bytes(sent: helpers.Sent, index: int = 0) -> bytes:
    return bytes(sent.segments[index][0])


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_Serializer_roundtrips_every_dtype(serializer: Serializer, dtype: torch.dtype) -> None:
    tensor = random_tensor(dtype, (3, 4))
    sent = roundtrip(serializer, tensor)
    assert sent.value.dtype == dtype
    assert same_bits(sent.value, tensor)
    assert len(sent.segments) == 1
    assert segment_bytes(sent) == tensor_bytes(tensor)


@pytest.mark.filterwarnings("ignore:.*quantiz.*:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.qint32], ids=str)
def test_Serializer_roundtrips_quantized_through_torch(
    serializer: Serializer, dtype: torch.dtype
) -> None:
    per_tensor = torch.quantize_per_tensor(torch.randn(2, 5), 0.1, 0, dtype)
    per_channel = torch.quantize_per_channel(
        torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, dtype
    )
    got_tensor, got_channel = roundtrip(serializer, (per_tensor, per_channel)).value
    assert got_tensor.dtype == dtype
    assert got_tensor.q_scale() == per_tensor.q_scale()
    assert torch.equal(got_tensor.int_repr(), per_tensor.int_repr())
    assert torch.equal(got_channel.q_per_channel_scales(), per_channel.q_per_channel_scales())
    assert torch.equal(got_channel.int_repr(), per_channel.int_repr())


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 1, 3), (5, 7, 2)], ids=str)
def test_Serializer_preserves_shape(serializer: Serializer, shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape, dtype=torch.float64)
    got = roundtrip(serializer, tensor).value
    assert got.shape == tensor.shape
    assert got.dim() == tensor.dim()
    assert torch.equal(got, tensor)


def test_Serializer_empty_tensor_sends_empty_segment(serializer: Serializer) -> None:
    tensor = torch.empty(4, 0, dtype=torch.int32)
    sent = roundtrip(serializer, [tensor, tensor])
    assert sent.segments[0][0].nbytes == 0
    assert sent.value[0] is sent.value[1]
    assert sent.value[0].shape == (4, 0)
    assert sent.value[0].dtype == torch.int32


@pytest.mark.parametrize(
    "view",
    [
        torch.randn(5, 6).t(),
        torch.randn(4, 5, 6).permute(2, 0, 1),
        torch.randn(4, 5, 6).transpose(0, 2),
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    ],
    ids=["t", "permute", "transpose", "channels_last"],
)
def test_Serializer_keeps_strides_of_dense_view(serializer: Serializer, view: torch.Tensor) -> None:
    assert not view.is_contiguous()
    sent = roundtrip(serializer, view)
    assert sent.value.stride() == view.stride()
    assert torch.equal(sent.value, view)
    assert sent.segments[0][0].nbytes == view.numel() * view.element_size()


def test_Serializer_small_view_of_big_tensor_sends_only_its_bytes(serializer: Serializer) -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    view = big[1000:1010]
    sent = roundtrip(serializer, view)
    assert segment_bytes(sent) == tensor_bytes(torch.arange(1000, 1010, dtype=torch.float32))
    assert torch.equal(sent.value, view)


def test_Serializer_small_dense_block_of_big_tensor_sends_only_its_bytes(
    serializer: Serializer,
) -> None:
    big = torch.randn(1000, 100)
    block = big[10:12]  # contiguous rows in the middle of the storage
    sent = roundtrip(serializer, block)
    assert sent.segments[0][0].nbytes == block.numel() * 4
    assert torch.equal(sent.value, block)


def test_Serializer_gapped_view_is_sent_contiguous(serializer: Serializer) -> None:
    big = torch.randn(1000, 100)
    column = big[:, 0]
    sent = roundtrip(serializer, column)
    assert sent.segments[0][0].nbytes == column.numel() * 4
    assert sent.value.is_contiguous()
    assert torch.equal(sent.value, column)


def test_Serializer_expanded_view_sends_distinct_elements_once(serializer: Serializer) -> None:
    row = torch.arange(3, dtype=torch.float32)
    expanded = row.expand(1000, 3)
    sent = roundtrip(serializer, expanded)
    assert sent.segments[0][0].nbytes == 3 * 4
    assert sent.value.stride() == (0, 1)
    assert torch.equal(sent.value, expanded)


def test_Serializer_overlapping_view_arrives_equal(serializer: Serializer) -> None:
    base = torch.arange(10, dtype=torch.int64)
    windows = base.as_strided((4, 3), (2, 1), 1)  # rows overlap: [1,2,3], [3,4,5]...
    sent = roundtrip(serializer, windows)
    assert torch.equal(sent.value, windows)
    assert sent.value.stride() == (2, 1)
    assert sent.segments[0][0].nbytes == 9 * 8  # elements 1..9 only


def test_Serializer_same_tensor_twice_arrives_as_one_object(serializer: Serializer) -> None:
    tensor = torch.randn(5)
    sent = roundtrip(serializer, {"a": tensor, "b": [tensor, (tensor,)]})
    assert len(sent.segments) == 1
    assert sent.value["a"] is sent.value["b"][0]
    assert sent.value["a"] is sent.value["b"][1][0]


def test_Serializer_two_views_of_one_storage_travel_separately(serializer: Serializer) -> None:
    base = torch.randn(6)
    sent = roundtrip(serializer, [base[:3], base[3:]])
    assert len(sent.segments) == 2
    first, second = sent.value
    assert torch.equal(torch.cat([first, second]), base)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_Serializer_preserves_parameter(serializer: Serializer, requires_grad: bool) -> None:
    param = torch.nn.Parameter(torch.randn(3, 2), requires_grad=requires_grad)
    got = roundtrip(serializer, param).value
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad is requires_grad
    assert torch.equal(got.detach(), param.detach())


def test_Serializer_preserves_requires_grad(serializer: Serializer) -> None:
    leaf = torch.randn(4, requires_grad=True)
    result = leaf * 2  # a non-leaf: arrives as a leaf that requires grad
    got_leaf, got_result, got_plain = roundtrip(serializer, (leaf, result, torch.ones(2))).value
    assert type(got_leaf) is torch.Tensor
    assert got_leaf.requires_grad
    assert got_result.requires_grad
    assert got_result.is_leaf
    assert not got_plain.requires_grad
    got_leaf.sum().backward()  # type: ignore[no-untyped-call]
    assert got_leaf.grad is not None
    assert torch.equal(got_leaf.grad, torch.ones(4))


def test_Serializer_resolves_conjugate_bit(serializer: Serializer) -> None:
    tensor = torch.randn(3, dtype=torch.complex64)
    got = roundtrip(serializer, tensor.conj()).value
    assert not got.is_conj()
    assert torch.equal(got, tensor.conj().resolve_conj())


def test_Serializer_received_tensor_uses_allocator_memory(serializer: Serializer) -> None:
    tensor = torch.randn(64, 32)
    sent = roundtrip(serializer, tensor)
    owner = sent.owners[0]
    assert isinstance(owner, torch.Tensor)
    assert sent.value.data_ptr() == owner.data_ptr()
    owner.view(torch.float32)[0] = 123.0  # writes through: same memory, no copy
    assert sent.value[0, 0].item() == 123.0


def test_Serializer_allocate_returns_writable_view_of_owner(serializer: Serializer) -> None:
    owner, view = serializer.allocate(16, "cpu")
    assert isinstance(owner, torch.Tensor)
    assert owner.dtype == torch.uint8
    assert owner.numel() == 16
    assert not view.readonly
    assert view.nbytes == 16
    view[:] = bytes(range(16))
    assert owner.tolist() == list(range(16))


def test_Serializer_large_tensor_roundtrips_in_a_recycled_buffer(serializer: Serializer) -> None:
    # 40 MiB takes the pooled-buffer path: the bytes must land and stay writable, and the
    # buffer is handed out again only once no tensor uses it.
    tensor = torch.arange(10 << 20, dtype=torch.float32).reshape(-1, 1024).t()
    sent = roundtrip(serializer, tensor)
    assert torch.equal(sent.value, tensor)
    sent.value[0, 0] = -1.0
    assert sent.value[0, 0].item() == -1.0
    first = sent.value.data_ptr()
    view = sent.value[1:]
    del sent
    gc.collect()
    while_viewed = roundtrip(serializer, tensor).value
    assert while_viewed.data_ptr() != first  # a view still uses the first buffer
    del view, while_viewed
    gc.collect()
    assert roundtrip(serializer, tensor).value.data_ptr() == first


def test_Serializer_allocate_zero_bytes(serializer: Serializer) -> None:
    owner, view = serializer.allocate(0, "cpu")
    assert isinstance(owner, torch.Tensor)
    assert owner.numel() == 0
    assert view.nbytes == 0


def test_Serializer_loads_accepts_bytes_like_segments(serializer: Serializer) -> None:
    tensor = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    payload, segments, _keepalive, _ = serializer.dumps(tensor)
    got = serializer.loads(payload, [bytes(segments[0][0])])
    assert torch.equal(got, tensor)


def test_Serializer_segments_are_read_only_views_of_tensor(serializer: Serializer) -> None:
    tensor = torch.zeros(4)
    _payload, segments, keepalive, _ = serializer.dumps(tensor)
    view, tag = segments[0]
    assert view.readonly
    assert tag == "cpu"
    assert keepalive[0] is tensor
    tensor[0] = 1.0  # no copy was taken: the segment sees later writes
    assert bytes(view[:4]) == tensor_bytes(torch.tensor([1.0]))


def test_Serializer_sparse_coo_roundtrip(serializer: Serializer) -> None:
    indices = torch.tensor([[0, 1, 2], [2, 0, 1]])
    values = torch.tensor([1.0, 2.0, 3.0])
    sparse = torch.sparse_coo_tensor(indices, values, (3, 3), check_invariants=True)
    pending_before = len(torch._utils._sparse_tensors_to_validate)
    sent = roundtrip(serializer, sparse)
    assert sent.value.layout == torch.sparse_coo
    assert torch.equal(sent.value.to_dense(), sparse.to_dense())
    assert len(sent.segments) == 2  # indices and values travelled out-of-band
    assert len(torch._utils._sparse_tensors_to_validate) == pending_before


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
def test_Serializer_sparse_csr_roundtrip(serializer: Serializer) -> None:
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 3.0]])
    csr = dense.to_sparse_csr()
    sent = roundtrip(serializer, csr)
    assert sent.value.layout == torch.sparse_csr
    assert torch.equal(sent.value.to_dense(), dense)
    assert len(sent.segments) == 3


def test_Serializer_nested_containers_and_dataclasses(serializer: Serializer) -> None:
    batch = helpers.Batch(
        inputs=torch.randn(2, 3),
        labels=[torch.tensor([1]), torch.tensor([0])],
        meta={"step": 3, "mask": torch.tensor([True, False]), "nested": ({"t": torch.ones(1)},)},
    )
    got = roundtrip(serializer, {"batch": batch, "extra": [batch.inputs]}).value
    assert isinstance(got["batch"], helpers.Batch)
    assert torch.equal(got["batch"].inputs, batch.inputs)
    assert got["extra"][0] is got["batch"].inputs
    assert [label.item() for label in got["batch"].labels] == [1, 0]
    assert torch.equal(got["batch"].meta["mask"], batch.meta["mask"])
    assert torch.equal(got["batch"].meta["nested"][0]["t"], torch.ones(1))


def test_Serializer_tensor_never_enters_payload(serializer: Serializer) -> None:
    tensor = torch.full((1024,), 7.0)
    payload, segments, _keepalive, _ = serializer.dumps(tensor)
    assert len(payload) < 200
    assert segments[0][0].nbytes == 4096


def test_Serializer_cpu_tensor_ignores_device_map(serializer: Serializer) -> None:
    sent = roundtrip(serializer, torch.ones(2), policy=HostCopy({"cuda:0": "cuda:1"}))
    assert sent.segments[0][1] == "cpu"
    assert sent.value.device == torch.device("cpu")


def test_Serializer_meta_tensor_goes_through_torch(serializer: Serializer) -> None:
    meta = torch.empty(3, 4, device="meta")
    sent = roundtrip(serializer, meta)
    assert sent.segments == []
    assert sent.value.is_meta
    assert sent.value.shape == (3, 4)


def test_Serializer_missing_segment_raises(serializer: Serializer) -> None:
    payload, _segments, _keepalive, _ = serializer.dumps(torch.ones(3))
    with pytest.raises(SerializationError):
        serializer.loads(payload, [])


def test_import_tensor_unknown_dtype_raises() -> None:
    descriptor = (TENSOR_PID, 0, "float128", (1,), (1,), 0, False, False, "cpu")
    with pytest.raises(SerializationError, match="float128"):
        import_tensor(descriptor, torch.empty(16, dtype=torch.uint8))


def test_Serializer_complex32_roundtrip_without_arithmetic(serializer: Serializer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        half = torch.randn(4, dtype=torch.complex64).to(torch.complex32)
    got = roundtrip(serializer, half.reshape(2, 2).t()).value
    assert got.dtype == torch.complex32
    assert got.stride() == (1, 2)
    assert same_bits(got, half.reshape(2, 2).t())


def test_Serializer_tensor_subclass_goes_through_torch(serializer: Serializer) -> None:
    tagged = torch.arange(4.0).as_subclass(helpers.TaggedTensor)
    got = roundtrip(serializer, tagged).value
    assert type(got) is helpers.TaggedTensor
    assert torch.equal(got.as_subclass(torch.Tensor), torch.arange(4.0))


# -- small tensors inside the payload ------------------------------------------------------


@pytest.fixture
def inlining() -> Serializer:
    return Serializer()  # the default: tensors up to SMALL_TENSOR_BYTES go in the payload


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_Serializer_small_tensor_travels_in_payload_bit_exact(
    inlining: Serializer, dtype: torch.dtype
) -> None:
    tensor = random_tensor(dtype, (3, 5))
    sent = roundtrip(inlining, tensor)
    assert sent.segments == []
    assert sent.value.dtype == dtype
    assert sent.value.view(torch.uint8).tolist() == tensor.view(torch.uint8).tolist()


def test_Serializer_small_tensor_keeps_strides_and_flags(inlining: Serializer) -> None:
    transposed = torch.arange(12.0).reshape(3, 4).t()
    param = torch.nn.Parameter(torch.ones(2))
    grad = torch.zeros(3, requires_grad=True)
    value = roundtrip(inlining, [transposed, param, grad]).value
    assert torch.equal(value[0], transposed)
    assert value[0].stride() == transposed.stride()
    assert type(value[1]) is torch.nn.Parameter
    assert value[1].requires_grad
    assert value[2].requires_grad


def test_Serializer_small_tensor_twice_arrives_as_one_object(inlining: Serializer) -> None:
    tensor = torch.ones(4)
    value = roundtrip(inlining, {"a": tensor, "b": [tensor]}).value
    assert value["a"] is value["b"][0]


def test_Serializer_small_tensor_is_a_copy_resolving_conj_and_neg(inlining: Serializer) -> None:
    base = torch.tensor([1 + 2j, 3 - 1j])
    sent = roundtrip(inlining, [base.conj(), base.conj()._neg_view()])
    assert torch.equal(sent.value[0], base.conj().resolve_conj())
    assert torch.equal(sent.value[1], -base.conj().resolve_conj())
    assert not sent.value[0].is_conj()
    sent.value[0][0] = 0  # writable, and not the sender's memory
    assert base[0] == 1 + 2j


def test_Serializer_tensor_over_the_limit_goes_as_segment(inlining: Serializer) -> None:
    limit = SMALL_TENSOR_BYTES // 4
    sent = roundtrip(inlining, [torch.ones(limit), torch.ones(limit + 1)])
    assert [view.nbytes for view, _ in sent.segments] == [(limit + 1) * 4]
    assert torch.equal(sent.value[0], torch.ones(limit))
    assert torch.equal(sent.value[1], torch.ones(limit + 1))


def test_rebuild_small_tensor_malformed_raises_serialization_error() -> None:
    _, (packed,) = reduce_small_tensor(torch.ones(2, 3))
    assert torch.equal(rebuild_small_tensor(packed), torch.ones(2, 3))
    with pytest.raises(SerializationError):
        rebuild_small_tensor(packed[:5])  # cut inside the layout
    with pytest.raises(SerializationError):
        rebuild_small_tensor(b"\x03zzz" + packed[8:])  # an unknown dtype name


def test_Serializer_small_tensor_edge_shapes(inlining: Serializer) -> None:
    scalar, empty, gapped = torch.tensor(3.5), torch.empty(0, 3), torch.ones(4, 3)[:, 1]
    sent = roundtrip(inlining, [scalar, empty, gapped])
    assert sent.segments == []
    assert sent.value[0].shape == ()
    assert sent.value[0].item() == 3.5
    assert sent.value[1].shape == (0, 3)
    assert torch.equal(sent.value[2], gapped)


def test_Serializer_view_with_small_gaps_keeps_its_strides(serializer: Serializer) -> None:
    t = torch.rand(5, 5)
    view = t.narrow(1, 2, 2)  # two columns: gaps of three elements per row
    sent = roundtrip(serializer, view)
    assert not sent.value.is_contiguous()
    assert sent.value.stride() == view.stride()
    assert torch.equal(sent.value, view)


def test_tensors_requiring_grad_are_listed_in_one_order_on_both_sides(
    inlining: Serializer,
) -> None:
    # Distributed autograd pairs the tensors requiring grad of a message by position: the
    # sender's list (exported) and the receiver's (imported) must match, small tensors
    # inside the pickle and big ones in segments alike, each listed once.
    small_a = torch.randn(3, requires_grad=True)
    big = torch.randn(SMALL_TENSOR_BYTES // 4 + 1, requires_grad=True)
    small_b = nn.Parameter(torch.randn(2, 2))
    plain = torch.randn(4)
    message = {"x": [small_a, big, plain, small_a], "p": small_b, "again": big}
    sent_policy, received_policy = CallTensors(), CallTensors()
    sent_policy.track_grads()
    received_policy.track_grads()
    payload, segments, _, _ = inlining.dumps(message, policy=sent_policy)
    assert len(segments) == 1  # only the big one
    owners = []
    for view, tag in segments:
        owner, destination = inlining.allocate(view.nbytes, tag)
        destination[:] = view
        owners.append(owner)
    received = inlining.loads(payload, owners, policy=received_policy)
    assert sent_policy.grads == [small_a, big, small_b]
    assert received_policy.grads is not None
    assert len(received_policy.grads) == 3
    for got, want in zip(received_policy.grads, sent_policy.grads, strict=True):
        assert got.requires_grad
        assert torch.equal(got.detach(), want.detach())
    assert received_policy.grads[0] is received["x"][0] is received["x"][3]
    assert received_policy.grads[1] is received["again"]
    assert isinstance(received_policy.grads[2], nn.Parameter)
