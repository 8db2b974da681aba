"""Tensors through a real worker of the shared group: dtypes, layouts, identity, big ones.

Values go to a worker and back (``remote_fns.echo``), so every tensor crosses the wire twice
and is rebuilt by a different process each way.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # torch warns at import without numpy
    import torch

import asyncrpc
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)

# The dtype list of tests/unit/test_serde_tensors.py: every dtype this torch has.
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
PLAIN_DTYPES = [dtype for dtype in ALL_DTYPES if dtype not in QUANTIZED]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (works for dtypes with no arithmetic, e.g. float8)."""
    itemsize = torch.empty(0, dtype=torch.uint8).view(dtype).element_size()
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, also for dtypes torch.equal does not implement (float8, bits...)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(flat_a, flat_b)


def echo(value: Any, to: str = "w1") -> Any:
    return asyncrpc.rpc_sync(to, fns.echo, args=(value,))


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
def test_echo_roundtrips_every_dtype_bitwise(group: Group, dtype: torch.dtype) -> None:
    tensor = random_tensor(dtype, (3, 5))
    got = echo(tensor, to="w2")
    assert type(got) is torch.Tensor
    assert same_bits(got, tensor)


@pytest.mark.filterwarnings("ignore:.*quantiz.*:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.qint32], ids=str)
def test_echo_roundtrips_quantized(group: Group, dtype: torch.dtype) -> None:
    per_tensor = torch.quantize_per_tensor(torch.randn(2, 5), 0.1, 0, dtype)
    per_channel = torch.quantize_per_channel(
        torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, dtype
    )
    got_tensor, got_channel = echo((per_tensor, per_channel))
    assert got_tensor.dtype == dtype
    assert got_channel.dtype == dtype
    assert torch.equal(got_tensor.int_repr(), per_tensor.int_repr())
    assert got_tensor.q_scale() == per_tensor.q_scale()
    assert torch.equal(got_channel.int_repr(), per_channel.int_repr())
    assert torch.equal(got_channel.q_per_channel_scales(), per_channel.q_per_channel_scales())


def test_transposed_tensor_keeps_its_strides(group: Group) -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()
    described = asyncrpc.rpc_sync("w1", fns.describe_tensor, args=(tensor,))
    assert described["shape"] == [4, 3]
    assert described["stride"] == [1, 4]
    got = echo(tensor)
    assert got.stride() == (1, 4)
    assert torch.equal(got, tensor)


def test_expanded_tensor_travels_with_zero_strides(group: Group) -> None:
    tensor = torch.arange(3.0).reshape(3, 1).expand(3, 1000)
    assert asyncrpc.rpc_sync("w1", fns.storage_nbytes, args=(tensor,)) == 3 * 4
    got = echo(tensor)
    assert got.stride() == (1, 0)
    assert torch.equal(got, tensor)


def test_parameter_with_requires_grad_stays_a_parameter(group: Group) -> None:
    param = torch.nn.Parameter(torch.randn(4, 2))
    described = asyncrpc.rpc_sync("w3", fns.describe_tensor, args=(param,))
    assert described["is_param"] is True
    assert described["requires_grad"] is True
    got = echo(param, to="w3")
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad
    assert torch.equal(got.detach(), param.detach())
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    described = asyncrpc.rpc_sync("w3", fns.describe_tensor, args=(frozen,))
    assert described["is_param"] is True
    assert described["requires_grad"] is False
    leaf = torch.ones(2, requires_grad=True)
    described = asyncrpc.rpc_sync("w3", fns.describe_tensor, args=(leaf,))
    assert described["is_param"] is False
    assert described["requires_grad"] is True


@pytest.mark.parametrize("gapped", [False, True], ids=["slice", "column"])
def test_small_view_of_big_tensor_sends_only_the_view(group: Group, gapped: bool) -> None:
    base = torch.randn(2048, 2048)  # 16 MiB
    view = base[:, 7] if gapped else base[5, 100:164]
    view_bytes = view.numel() * view.element_size()
    before = asyncrpc.get_metrics()["bytes_out"]
    received = asyncrpc.rpc_sync("w1", fns.storage_nbytes, args=(view,))
    sent = asyncrpc.get_metrics()["bytes_out"] - before
    assert received == view_bytes
    assert view_bytes <= sent < view_bytes + 4096
    assert torch.equal(echo(view), view)


def test_same_tensor_twice_arrives_as_one_object(group: Group) -> None:
    tensor = torch.randn(8)
    assert asyncrpc.rpc_sync("w2", fns.same_object, args=(tensor, tensor)) is True
    assert asyncrpc.rpc_sync("w2", fns.same_object, args=(tensor, tensor.clone())) is False
    first, second = echo((tensor, tensor), to="w2")
    assert first is second
    assert torch.equal(first, tensor)


def test_sparse_coo_roundtrips(group: Group) -> None:
    indices = torch.tensor([[0, 1, 4, 2], [3, 0, 4, 2]])
    sparse = torch.sparse_coo_tensor(indices, torch.randn(4), (5, 5), check_invariants=True)
    sparse = sparse.coalesce()
    got = echo(sparse)
    assert got.layout is torch.sparse_coo
    assert got.is_coalesced()
    assert torch.equal(got.to_dense(), sparse.to_dense())
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True
    )
    got = echo(uncoalesced)
    assert not got.is_coalesced()
    assert torch.equal(got.to_dense(), torch.tensor([3.0, 0.0, 0.0]))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
def test_sparse_csr_roundtrips(group: Group) -> None:
    csr = torch.randn(4, 6).relu().to_sparse_csr()
    got = echo(csr)
    assert got.layout is torch.sparse_csr
    assert torch.equal(got.to_dense(), csr.to_dense())


def test_64_mib_tensor_echo_is_equal(group: Group) -> None:
    tensor = torch.randint(-(2**31), 2**31 - 1, (16 << 20,), dtype=torch.int32)
    before = asyncrpc.get_metrics()
    got = echo(tensor, to="w3")
    after = asyncrpc.get_metrics()
    assert torch.equal(got, tensor)
    assert after["bytes_out"] - before["bytes_out"] >= 64 << 20
    assert after["bytes_in"] - before["bytes_in"] >= 64 << 20


def test_nested_containers_of_tensors(group: Group) -> None:
    a, b, c = torch.randn(3), torch.arange(6).reshape(2, 3), torch.ones(2, dtype=torch.bool)
    value = {"list": [a, (b, {"inner": c})], "again": a, "empty": [], "n": 3, ("t",): [b]}
    got = echo(value, to="w2")
    assert set(got) == set(value)
    assert torch.equal(got["list"][0], a)
    assert torch.equal(got["list"][1][0], b)
    assert torch.equal(got["list"][1][1]["inner"], c)
    assert got["again"] is got["list"][0]  # one object in, one object out
    assert got[("t",)][0] is got["list"][1][0]
    assert got["empty"] == []
    assert got["n"] == 3
