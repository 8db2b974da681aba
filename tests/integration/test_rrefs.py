"""RRefs between real worker processes: creation, forks, proxies, reference counting."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc.errors import RRefError
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def _until_empty(worker: str, timeout: float = 10.0) -> dict[str, Any]:
    """Poll a worker's RRef counts until it owns and uses nothing (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        info = asyncrpc.rpc_sync(worker, fns.rref_debug) if worker != "driver" else fns.rref_debug()
        if all(v == 0 for v in info.values()) or time.monotonic() > deadline:
            return info
        time.sleep(0.02)


def test_remote_and_to_here_on_another_worker(group: Group) -> None:
    rref = asyncrpc.remote("w1", fns.add, args=(torch.ones(3), 1))
    assert not rref.is_owner()
    assert rref.owner() == asyncrpc.WorkerInfo("w1", 1)
    assert rref.owner_name() == "w1"
    assert torch.equal(rref.to_here(), torch.full((3,), 2.0))
    assert rref.confirmed_by_owner()
    with pytest.raises(RRefError):
        rref.local_value()
    del rref
    assert _until_empty("w1")["owner_rrefs"] == 0


def test_remote_to_self_is_an_owner_rref(group: Group) -> None:
    rref = asyncrpc.remote("driver", fns.add, args=(2, 3))
    assert rref.is_owner()
    assert rref.to_here() == 5
    assert rref.local_value() == 5


def test_every_kind_of_callable_through_remote(group: Group) -> None:
    assert asyncrpc.remote("w2", fns.async_add, args=(1, 2)).to_here() == 3
    assert torch.equal(
        asyncrpc.remote("w3", torch.add, args=(torch.ones(2), torch.ones(2))).to_here(),
        torch.full((2,), 2.0),
    )
    assert torch.equal(
        asyncrpc.remote("w1", fns.script_add, args=(torch.zeros(2), 3)).to_here(),
        torch.full((2,), 3.0),
    )
    assert asyncrpc.remote("w1", fns.async_exec_add, args=("w2", 1, 1)).to_here() == 20


def test_creation_error_surfaces_on_to_here_as_original_type(group: Group) -> None:
    rref = asyncrpc.remote("w1", fns.raise_key_error, args=("k",))
    with pytest.raises(KeyError):
        rref.to_here()
    with pytest.raises(KeyError):
        rref.rpc_sync().anything()


def test_remote_timeout_makes_the_rref_unusable(group: Group) -> None:
    rref = asyncrpc.remote("w3", fns.sleep, args=(1.0,), timeout=0.2)
    with pytest.raises(asyncrpc.RRefTimeoutError):
        rref.to_here()
    with pytest.raises(asyncrpc.RRefTimeoutError):
        rref.to_here()


@pytest.mark.asyncio
async def test_to_here_future_is_awaitable(group: Group) -> None:
    rref = asyncrpc.remote("w2", fns.add, args=(20, 22))
    assert await rref.to_here_future() == 42
    assert rref.to_here_future().wait() == 42


def test_local_owner_rref_passed_to_a_worker(group: Group) -> None:
    rref = asyncrpc.RRef(torch.arange(4))
    assert rref.is_owner()
    assert rref.confirmed_by_owner()
    assert torch.equal(asyncrpc.rpc_sync("w1", fns.fetch, args=(rref,)), torch.arange(4))
    # Back to its owner: the owner sees its own value, not a copy.
    assert asyncrpc.rpc_sync("w1", fns.forward_to, args=(rref, "driver")).tolist() == [0, 1, 2, 3]


def test_an_rref_coming_home_in_calls_wakes_no_loop_on_its_owner(group: Group) -> None:
    # A model behind an RRef gets it back as an argument every step: the owner drops that
    # handle on the lane thread that served the call, without waking its loop for it.
    assert _until_empty("w1")["owner_rrefs"] == 0
    rref = asyncrpc.remote("w1", torch.ones, args=(3,))
    assert rref.to_here().tolist() == [1.0, 1.0, 1.0]

    def loop_wakes() -> int:
        return int(asyncrpc.rpc_sync("w1", fns.metrics)["handoffs_thread_to_loop"])

    reading = -loop_wakes() + loop_wakes()  # what reading the count costs, if anything
    before = loop_wakes()
    for _ in range(20):
        assert asyncrpc.rpc_sync("w1", fns.local_value_of, args=(rref,)).tolist() == [1.0] * 3
    assert loop_wakes() - before == reading
    del rref  # and the value is still freed once the last reference goes
    assert _until_empty("w1")["owner_rrefs"] == 0


def test_rref_returned_as_a_result(group: Group) -> None:
    rref = asyncrpc.rpc_sync("w2", fns.owned_here, args=("held on w2",))
    assert rref.owner_name() == "w2"
    assert rref.to_here() == "held on w2"
    assert asyncrpc.rpc_sync("w2", fns.is_owner_of, args=(rref,)) is True
    assert asyncrpc.rpc_sync("w2", fns.local_value_of, args=(rref,)) == "held on w2"


def test_fork_user_to_user_to_third_then_dropped_everywhere(group: Group) -> None:
    assert _until_empty("w1")["owner_rrefs"] == 0  # earlier tests' references are gone
    rref = asyncrpc.remote("w1", fns.make_counter, args=(7,))
    # driver (user) -> w2 (user) -> w3 (user): two user-to-user forks.
    assert asyncrpc.rpc_sync("w2", fns.forward_to, args=(rref, "w3")).count == 7
    assert asyncrpc.rpc_sync("w2", fns.hold, args=(rref,)) >= 1
    del rref
    gc.collect()
    assert asyncrpc.rpc_sync("w1", fns.rref_debug)["owner_rrefs"] == 1  # w2 still holds it
    asyncrpc.rpc_sync("w2", fns.drop_held)
    for worker in ("w1", "w2", "w3", "driver"):
        assert _until_empty(worker) == dict.fromkeys(
            ("owner_rrefs", "user_rrefs", "pending_forks", "pending_users"), 0
        ), worker


def test_to_here_by_a_third_worker_while_the_remote_is_still_arriving(group: Group) -> None:
    # w2 fetches an RRef the driver made while w1 is still reading the driver's 64 MiB
    # remote() frame: w2's fetch must wait for the value, not fail on an unknown RRef.
    rref = asyncrpc.remote("w1", fns.total, args=(torch.ones(16 << 20),))
    assert asyncrpc.rpc_sync("w2", fns.fetch, args=(rref,)) == float(16 << 20)
    assert rref.to_here() == float(16 << 20)  # and the creator fetches it by id


def test_proxy_runs_inline_methods_on_the_owner_loop(group: Group) -> None:
    counter = asyncrpc.remote("w1", fns.make_counter, args=(0,))
    assert counter.rpc_sync().runs_on() == "pool"
    assert counter.rpc_sync().inline_runs_on() == "loop"
    assert counter.rpc_async().inline_runs_on().wait() == "loop"


def test_rrefs_inside_nested_containers(group: Group) -> None:
    tree = {
        "list": [asyncrpc.remote("w1", fns.add, args=(1, 1)), asyncrpc.RRef(3)],
        "inner": {"rref": asyncrpc.remote("w2", fns.add, args=(10, 0))},
    }
    assert asyncrpc.rpc_sync("w3", fns.sum_nested, args=(tree,)) == 15


def test_proxies_run_methods_on_the_owner(group: Group) -> None:
    counter = asyncrpc.remote("w1", fns.Counter, args=(0,))
    assert counter.rpc_sync().increment(5) == 5
    assert counter.rpc_async().increment(2).wait() == 7
    assert counter.rpc_sync().slow_value() == 7  # async def method
    assert counter.rpc_sync().deferred_add(3) == 10  # @async_execution method
    assert counter.remote().value().to_here() == 10
    assert asyncrpc.RRef(fns.Counter(1)).rpc_sync().increment() == 2  # proxy on an owner


def test_rref_type_hint(group: Group) -> None:
    alias = asyncrpc.RRef[int]
    assert alias.__origin__ is asyncrpc.RRef  # type: ignore[attr-defined]


def test_rref_cannot_be_pickled_outside_rpc(group: Group) -> None:
    import pickle

    with pytest.raises(RRefError):
        pickle.dumps(asyncrpc.RRef(1))


def test_parameter_server_updated_through_proxies_from_several_callers(group: Group) -> None:
    ps = asyncrpc.remote("w1", fns.ParameterServer)
    before = ps.rpc_sync().get_weights()
    futures = [asyncrpc.rpc_async(w, fns.train_steps, args=(ps, 5)) for w in ("w2", "w3")]
    errors: list[BaseException] = []

    def local_trainer() -> None:
        try:
            fns.train_steps(ps, 5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=local_trainer) for _ in range(2)]
    for t in threads:
        t.start()
    asyncrpc.wait_all(futures)
    for t in threads:
        t.join(30)
    assert not errors
    after = ps.rpc_sync().get_weights()
    # 4 callers x 5 steps, each subtracting 0.01 from every parameter.
    assert torch.allclose(after["bias"], before["bias"] - 20 * 0.01, atol=1e-5)


def test_rref_get_type_asks_the_owner_once(group: Group) -> None:
    rref = asyncrpc.remote("w1", fns.add, args=(20, 22))
    assert rref._get_type() is int
    first = rref._get_type(blocking=False)
    assert first is rref._get_type(blocking=False)  # cached: one question to the owner
    assert first.wait() is int
    assert asyncrpc.RRef(torch.ones(1))._get_type() is torch.Tensor
    assert asyncrpc.RRef(3, type_hint=float)._get_type() is float


def test_rref_get_future_completes_once_the_value_is_made(group: Group) -> None:
    made = asyncrpc.remote("w1", fns.add, args=(1, 2))
    assert made._get_future().wait(10) is None
    failing = asyncrpc.remote("w1", fns.raise_key_error, args=("k",))
    with pytest.raises(KeyError):
        failing._get_future().wait(10)
    with pytest.raises(KeyError):
        failing._get_type()


def test_remote_proxy_of_a_missing_method_raises_attribute_error_at_once(group: Group) -> None:
    counter = asyncrpc.remote("w1", fns.make_counter, args=(7,))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        counter.remote().nope()
    assert counter.remote().value().to_here() == 7


def test_rref_str_uses_torchs_words(group: Group) -> None:
    owned = asyncrpc.RRef(1)
    assert str(owned).startswith("OwnerRRef(GloballyUniqueId(created_on=0, local_id=")
    user = asyncrpc.remote("w1", fns.add, args=(1, 1))
    assert str(user).startswith("UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=")
    with pytest.raises(RRefError, match=r"can't call localValue\(\) on user"):
        user.local_value()


@pytest.mark.parametrize(
    "fn", [fns.make_lock_holder, fns.async_make_lock_holder, fns.async_exec_lock_holder]
)
def test_remote_to_self_keeps_an_unpicklable_value_unpickled(group: Group, fn: Any) -> None:
    # torch's rule: the result of a remote() to oneself becomes the owner's value as it is.
    rref = asyncrpc.remote("driver", fn, args=(7,))
    held = rref.to_here()
    assert isinstance(held, fns.LockHolder)
    assert held is rref.local_value()
    assert held.value == 7
    assert held.made_in == os.getpid()
    assert rref._get_future().wait() is None


def test_remote_to_self_of_builtins_and_script_functions_returns_the_object(group: Group) -> None:
    x = torch.ones(3)
    for fn, args in ((torch.add, (x, 1)), (fns.script_add, (x, 2))):
        rref = asyncrpc.remote("driver", fn, args=args)
        assert rref.to_here() is rref.local_value()
    assert torch.equal(rref.local_value(), torch.full((3,), 3.0))


def test_remote_to_self_still_pickles_its_arguments(group: Group) -> None:
    x = torch.zeros(2)
    rref = asyncrpc.remote("driver", fns.echo, args=(x,))
    assert torch.equal(rref.to_here(), x)
    assert rref.to_here() is not x
    with pytest.raises(asyncrpc.SerializationError):
        asyncrpc.remote("driver", fns.echo, args=(threading.Lock(),))


def test_remote_to_self_raises_the_functions_error_and_frees_the_value(group: Group) -> None:
    assert _until_empty("driver")["owner_rrefs"] == 0
    rref = asyncrpc.remote("driver", fns.raise_key_error, args=("k",))
    with pytest.raises(KeyError):
        rref.to_here()
    with pytest.raises(KeyError):
        rref.local_value()
    del rref
    # The owner keeps the failure while the RRef lives; raising it must not tie this
    # frame (and the RRef in it) to the kept exception, or neither would ever go.
    assert _until_empty("driver")["owner_rrefs"] == 0


def test_remote_to_self_on_another_worker(group: Group) -> None:
    same, made_in, value = asyncrpc.rpc_sync("w2", fns.remote_to_self_here, args=(5,))
    assert same
    assert value == 5
    assert made_in == asyncrpc.rpc_sync("w2", fns.pid)
