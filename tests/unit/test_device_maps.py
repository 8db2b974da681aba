"""Unit tests of the device-map checks init_rpc runs before joining (no GPU needed: the
device count is an argument)."""

from __future__ import annotations

import pytest

from asyncrpc.errors import InitError
from asyncrpc.runtime.cuda.maps import DeviceMapError, check_device_maps


def test_valid_maps_and_devices_pass() -> None:
    check_device_maps("w0", {"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}, None, 2)
    check_device_maps("w0", {"w1": {"cuda:1": "cuda:0"}}, ["cuda:1", "cpu"], 2)
    check_device_maps("w0", None, None, 0)  # a CPU-only worker


def test_error_is_both_an_InitError_and_a_ValueError() -> None:
    assert issubclass(DeviceMapError, InitError)
    assert issubclass(DeviceMapError, ValueError)


@pytest.mark.parametrize(
    ("maps", "devices", "count", "message"),
    [
        ({"w1": {"cuda:0": "cuda:0"}}, None, 0, r"maps devices it does not have: \['cuda:0'\]"),
        ({"w1": {"cuda:2": "cuda:0"}}, None, 2, r"does not have: \['cuda:2'\]"),
        ({"w1": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}, None, 2, "not one-to-one"),
        (None, ["cuda:0", "cuda:0"], 1, "lists a device twice"),
        (None, ["cuda:3"], 2, r"names devices it does not have: \['cuda:3'\]"),
        ({"w1": {"cuda:1": "cuda:0"}}, ["cuda:0"], 2, r"maps \['cuda:1'\], which are not in"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(
    maps: dict[str, dict[str, str]] | None, devices: list[str] | None, count: int, message: str
) -> None:
    with pytest.raises(DeviceMapError, match=message) as caught:
        check_device_maps("w0", maps, devices, count)
    assert "'w0'" in str(caught.value)


@pytest.mark.parametrize("transfer", ["auto", "ipc", "staged", "host"])
def test_cuda_transfer_options_are_accepted_and_mean_nothing_without_cuda(transfer: str) -> None:
    import torch

    from asyncrpc.protocol.options import RpcBackendOptions
    from asyncrpc.runtime.cuda.staging import cuda_transfer

    options = RpcBackendOptions(cuda_transfer=transfer)
    if not torch.cuda.is_available():
        assert cuda_transfer(options, lambda rank: True) is None  # the host copy's hook


def test_an_unknown_cuda_transfer_is_an_init_error() -> None:
    from asyncrpc.protocol.options import RpcBackendOptions

    with pytest.raises(InitError):
        RpcBackendOptions(cuda_transfer="nvlink")
