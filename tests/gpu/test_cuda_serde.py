"""CUDA tensors through the serializer: device maps and stream sync (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde import Serializer
from asyncrpc.runtime.cuda.maps import HostCopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _round_trip(obj: object, device_map: dict[str, str] | None) -> object:
    serializer = Serializer()
    policy = None if device_map is None else HostCopy(device_map)
    payload, segments, _keep, _ = serializer.dumps(obj, policy=policy)
    owners = []
    for view, tag in segments:
        owner, dest = serializer.allocate(view.nbytes, tag)
        dest[:] = view
        owners.append(owner)
    return serializer.loads(payload, owners)


def test_Serializer_cuda_tensor_follows_the_device_map() -> None:
    t = torch.arange(1024, dtype=torch.float32, device="cuda:0") * 2  # pending kernel
    out = _round_trip(t, {"cuda:0": "cuda:0"})
    assert isinstance(out, torch.Tensor)
    assert out.device == torch.device("cuda:0")
    assert torch.equal(out, t)


def test_Serializer_cuda_tensor_without_a_map_is_refused() -> None:
    with pytest.raises(SerializationError):
        _round_trip(torch.zeros(2, device="cuda:0"), None)


def test_Serializer_cuda_to_cpu_map() -> None:
    out = _round_trip(torch.ones(3, device="cuda:0"), {"cuda:0": "cpu"})
    assert isinstance(out, torch.Tensor)
    assert out.device == torch.device("cpu")
