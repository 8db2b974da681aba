"""asyncrpc.nn.RemoteModule between real worker processes: forward, training, sending."""

from __future__ import annotations

import asyncio
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import asyncrpc
import asyncrpc.autograd
from asyncrpc.errors import SerializationError
from asyncrpc.nn import RemoteModule, ScriptRemoteModuleError, UnsupportedMethodError
from asyncrpc.optim import DistributedOptimizer
from tests.integration import remote_module_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def test_RemoteModule_forward_runs_on_the_owner(group: Group) -> None:
    rm = RemoteModule("w1/cpu", fns.WhereAmI, args=("t",), kwargs={"suffix": "!"})
    where, tag, word, doubled = rm.forward(torch.ones(2), word="w")
    assert (where, tag, word) == ("w1", "t!", "w")
    assert torch.equal(doubled, torch.full((2,), 2.0))
    assert rm(torch.ones(1))[0] == "w1"  # nn.Module.__call__ reaches forward too
    assert (rm.on, rm.device) == ("w1", "cpu")
    assert rm.get_module_rref().owner_name() == "w1"


@pytest.mark.parametrize(("device", "owner"), [("rank:3/cpu", "w3"), ("w3", "w3")])
def test_RemoteModule_accepts_torch_device_forms(group: Group, device: str, owner: str) -> None:
    rm = RemoteModule(device, fns.WhereAmI, args=("t",))
    assert rm.forward(torch.zeros(1))[0] == owner
    assert rm.device == "cpu"


def test_RemoteModule_forward_async_is_awaitable_and_waitable(group: Group) -> None:
    rm = RemoteModule("w1", fns.WhereAmI, args=("a",))
    future = rm.forward_async(torch.ones(1), "x")
    assert isinstance(future, asyncrpc.Future)
    assert future.wait()[:3] == ("w1", "a", "x")

    async def main() -> tuple[object, ...]:
        return await rm.forward_async(torch.ones(3), word="y")  # type: ignore[no-any-return]

    where, tag, word, doubled = asyncio.run(asyncio.wait_for(main(), 30))
    assert (where, tag, word) == ("w1", "a", "y")
    assert torch.equal(doubled, torch.full((3,), 2.0))  # type: ignore[arg-type]


def test_RemoteModule_trains_with_dist_autograd_like_a_local_module(group: Group) -> None:
    rm = RemoteModule("w1/cpu", fns.Affine, args=(7,))
    local = fns.Affine(7)
    before = [p.detach().clone() for p in local.parameters()]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))

    params = rm.remote_parameters()
    assert [p.owner_name() for p in params] == ["w1", "w1"]
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
    with asyncrpc.autograd.context() as context_id:
        loss = rm.forward(x, scale=2.0).pow(2).sum()
        asyncrpc.autograd.backward(context_id, [loss])
        optimizer.step(context_id)

    reference = torch.optim.SGD(local.parameters(), lr=0.5)
    local(x, scale=2.0).pow(2).sum().backward()
    reference.step()
    remote_after = [p.to_here() for p in rm.remote_parameters()]
    for theirs, ours, old in zip(remote_after, local.parameters(), before, strict=True):
        assert not torch.equal(ours, old)  # the step moved the weights
        torch.testing.assert_close(theirs, ours.detach())


def test_RemoteModule_remote_parameters_recurse(group: Group) -> None:
    rm = RemoteModule("w1", nn.Sequential, args=(nn.Linear(2, 2), nn.Linear(2, 1)))
    assert len(rm.remote_parameters()) == 4
    assert rm.remote_parameters(recurse=False) == []


@pytest.mark.parametrize("third", ["w3", "w2"])  # w2 runs init_rpc_async
def test_RemoteModule_sent_to_a_third_worker_runs_forward(group: Group, third: str) -> None:
    rm = RemoteModule("w1/cpu", fns.WhereAmI, args=("s",))
    rm.note = "stays here"
    assert asyncrpc.rpc_sync(third, fns.attributes, (rm,)) == [
        "on", "device", "is_device_map_set", "is_scriptable", "generated_methods",
        "module_rref", "forward_async", "forward",
    ]  # fmt: skip
    caller, (where, tag, _, _) = asyncrpc.rpc_sync(third, fns.forward_on_me, (rm, torch.ones(1)))
    assert (caller, where, tag) == (third, "w1", "s")
    assert asyncrpc.rpc_sync(third, fns.forward_async_on_me, (rm, torch.ones(1)))[0] == "w1"


def test_RemoteModule_init_from_module_rref_shares_the_module(group: Group) -> None:
    rm = RemoteModule("w1", fns.Affine, args=(3,))
    shared = asyncrpc.rpc_sync("w3", fns.wrap_module_rref, ("w1", rm.get_module_rref()))
    assert isinstance(shared, RemoteModule)
    x = torch.ones(1, 3)
    assert torch.equal(shared.forward(x), rm.forward(x))
    assert shared.get_module_rref().owner_name() == "w1"


def test_RemoteModule_train_and_eval_reach_the_owner(group: Group) -> None:
    rm = RemoteModule("w1", fns.Affine, args=(0,))
    assert rm.eval() is rm
    assert asyncrpc.rpc_sync("w1", fns.training_flag, (rm.get_module_rref(),)) is False
    rm.train()
    assert asyncrpc.rpc_sync("w1", fns.training_flag, (rm.get_module_rref(),)) is True


@pytest.mark.parametrize(
    ("method", "args"),
    [("parameters", ()), ("to", ("cpu",)), ("state_dict", ()), ("register_buffer", ("b", None))],
)
def test_RemoteModule_refuses_local_state_methods(
    group: Group, method: str, args: tuple[object, ...]
) -> None:
    rm = RemoteModule("w1", fns.Affine, args=(0,))
    with pytest.raises(UnsupportedMethodError, match=f"``{method}`` not supported") as caught:
        getattr(rm, method)(*args)
    assert isinstance(caught.value, ValueError)
    assert caught.value.method == method


def test_RemoteModule_refuses_plain_pickle(group: Group) -> None:
    rm = RemoteModule("w1", fns.Affine, args=(0,))
    with pytest.raises(SerializationError, match="only be pickled when using RPC"):
        pickle.dumps(rm)


def test_RemoteModule_constructor_error_surfaces_with_its_type(group: Group) -> None:
    failing = RemoteModule("w1", fns.FailingModule, args=("missing",))
    with pytest.raises(KeyError, match="missing"):
        failing.forward(torch.ones(1))
    not_a_module = RemoteModule("w3", fns.NotAModule, args=(1,))
    with pytest.raises(ValueError, match=r"returns an instance of <class nn\.Module>"):
        not_a_module.forward()


def test_RemoteModule_refuses_torchscript_interfaces(group: Group) -> None:
    with pytest.raises(ScriptRemoteModuleError):
        RemoteModule("w1", fns.Affine, args=(0,), _module_interface_cls=object)
    with pytest.raises(asyncrpc.UnknownWorkerError):
        RemoteModule("nobody/cpu", fns.Affine, args=(0,))


@pytest.mark.parametrize(
    ("device", "error", "text"),
    [
        ("w1/cuda:0/cuda:1", ValueError, "Could not parse remote_device"),
        ("/", ValueError, "Could not parse remote_device"),
        ("rank:x/cpu", ValueError, "Could not parse remote_device"),
        ("cpu", ValueError, "names a device but no worker"),
        ("w1/cpu2", RuntimeError, "Invalid device string"),
        ("w1/", RuntimeError, "Device string must not be empty"),
    ],
)
def test_RemoteModule_rejects_malformed_remote_devices(
    group: Group, device: str, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        RemoteModule(device, fns.Affine, args=(0,))


def test_RemoteModule_dropped_is_freed_without_the_garbage_collector(group: Group) -> None:
    """No reference cycle: a RemoteModule (and so its module RRef) goes as soon as the last
    reference does, even on a worker whose collector never runs; a method read from it
    still keeps it alive while held."""
    gc.disable()
    try:
        rm = RemoteModule("w1", nn.Linear, args=(2, 2))
        ref = weakref.ref(rm)
        forward = rm.forward
        del rm
        assert ref() is not None  # the bound method holds it
        assert forward(torch.ones(1, 2)).shape == (1, 2)
        del forward
        assert ref() is None
    finally:
        gc.enable()
